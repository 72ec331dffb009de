"""[target]: the model the drafter accelerates."""

from __future__ import annotations

from dataclasses import dataclass, field

from .base import Section


@dataclass
class TargetSettings(Section):
    name = "target"
    #: Local folder or hub id of a Transformers causal LM (safetensors weights).
    model: str = ""
    #: Hub revision, when `model` is a hub id.
    revision: str | None = None
    #: Compute dtype of the target: bfloat16, float16 or float32.
    dtype: str = "bfloat16"
    #: Device: auto (cuda when present), cpu, cuda, cuda:N.
    device: str = "auto"
    #: Layer ids whose outputs condition the drafter (DESIGN.md §3): id i = HF hidden_states[i+1];
    #: [] means auto (5 layers spread over the depth like the reference configs).
    layers: list[int] = field(default_factory=lambda: [1, 9, 17, 25, 33])
    #: Token id fed in the mask slots; must be a valid row of the target embedding.
    mask_token_id: int | None = None
    #: Executing code from the model repository is off unless turned on here.
    trust_remote_code: bool = False

    def validate(self) -> None:
        if self.dtype not in ("bfloat16", "float16", "float32"):
            self.fail("dtype", f"must be bfloat16, float16 or float32, got {self.dtype!r}.")
        if any(b <= a for a, b in zip(self.layers, self.layers[1:], strict=False)):
            self.fail("layers", f"must be strictly increasing, got {self.layers}.")
        if any(i < 0 for i in self.layers):
            self.fail("layers", f"must be >= 0, got {self.layers}.")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            self.fail("mask_token_id", f"must be >= 0, got {self.mask_token_id}.")
