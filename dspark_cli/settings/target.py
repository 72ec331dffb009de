"""[target]: the model the drafter accelerates."""

from __future__ import annotations

from dataclasses import dataclass

from ..target.dtypes import DTYPE_NAMES
from ..target.layers import AUTO, parse_layers
from .base import Section


@dataclass
class TargetSettings(Section):
    name = "target"
    input_paths = {"model": "model"}
    #: Local folder or hub id of a Transformers causal LM (safetensors weights).
    model: str = ""
    #: Hub revision, when `model` is a hub id.
    revision: str | None = None
    #: Compute dtype of the target: auto, bfloat16, float16 or float32 (target/dtypes.py DTYPE_NAMES).
    #: auto: bfloat16 on CUDA and on CPUs with native bf16 matmuls, else float32 (resolved on each
    #: machine that loads the target; the drafter computes in the same dtype at eval).
    dtype: str = "auto"
    #: Device: auto (cuda when present), cpu, cuda, cuda:N.
    device: str = "auto"
    #: Layer ids whose outputs condition the drafter (DESIGN.md §3): id i = HF hidden_states[i+1].
    #: "auto": `cache build` spreads 5 over the depth like the reference configs and records them;
    #: train takes the cache's, calibrate and eval the drafter's. An explicit list must match those.
    layers: list[int] | str = AUTO
    #: Token id fed in the mask slots; must be a valid row of the target embedding.
    mask_token_id: int | None = None
    #: Executing code from the model repository is off unless turned on here.
    trust_remote_code: bool = False
    #: Pack the frozen target's linear weights once where that makes its steps cheaper (CPU
    #: float32, and bf16 where oneDNN has native bf16: target/prepack.py). false: the plain path,
    #: e.g. to compare the two.
    prepack: bool = True
    #: Compile the drafter's slot-by-slot sampling loop with TorchInductor where eval and calibrate
    #: decode (model/block_sampler.py): ~170 small ops a block fused into a few C++ loops, ~20 s of
    #: compiling once per process. "auto": on CPU where a C++ compiler is found; true/false: always/
    #: never. A compile that fails falls back to the eager loop with one warning.
    compile_draft: bool | str = "auto"

    def validate(self) -> None:
        if isinstance(self.compile_draft, str) and self.compile_draft != "auto":
            self.fail("compile_draft", f"must be true, false or \"auto\", got {self.compile_draft!r}.")
        if self.dtype not in ("auto", *DTYPE_NAMES):
            self.fail("dtype", f"must be auto or one of {', '.join(DTYPE_NAMES)}, got {self.dtype!r}.")
        self.layers = parse_layers(self.layers, f"{self.name}.layers")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            self.fail("mask_token_id", f"must be >= 0, got {self.mask_token_id}.")
