"""The target model: load it, pick its layers, and capture their features (cache build and eval).

Layer id `i` is the output of decoder layer `i`, i.e. Transformers `hidden_states[i + 1]`
(DESIGN.md §3). The final hidden state is the one after the model's last norm: in Transformers 5
the base model's `hidden_states[-1]` (checked in tests: `lm_head(final) == logits`).

    model, tokenizer = load_target("runs/smollm2", dtype="bfloat16", device="cpu")
    layers = resolve_layers("auto", num_target_layers(model))
    hidden, final = capture_layers(model, input_ids, layers)   # [T, m*d], [T, d]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DsparkError
from ..manifest import canonical_hash

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

#: Config keys that name where or with what a model was saved, not what it computes.
_VOLATILE_CONFIG_KEYS = {"_name_or_path", "transformers_version", "dtype", "torch_dtype",
                         "_commit_hash", "_attn_implementation_autoset", "attn_implementation"}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise DsparkError(f"--dtype {dtype!r}: must be one of {', '.join(DTYPES)}.")
    return DTYPES[dtype]


def load_target(path_or_id: str, dtype: str | torch.dtype = "bfloat16", device: str = "auto",
                trust_remote_code: bool = False, revision: str | None = None) -> tuple[Any, Any]:
    """Load a causal LM (safetensors only) and its tokenizer, frozen and in eval mode."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not path_or_id:
        raise DsparkError("no target model given.", hint="pass --target PATH_OR_HUB_ID or set target.model.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path_or_id, revision=revision,
                                                  trust_remote_code=trust_remote_code)
        model = AutoModelForCausalLM.from_pretrained(
            path_or_id, revision=revision, dtype=resolve_dtype(dtype), use_safetensors=True,
            trust_remote_code=trust_remote_code)
    except OSError as e:
        raise DsparkError(f"target {path_or_id!r}: cannot load it ({str(e).splitlines()[0]}).",
                          hint="pass a local folder with config.json + *.safetensors or a hub id.") from e
    model.to(resolve_device(device)).eval()
    model.requires_grad_(False)
    return model, tokenizer


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def num_target_layers(model_or_config: Any) -> int:
    config = getattr(model_or_config, "config", model_or_config)
    return int(_text_config(config).num_hidden_layers)


def hidden_size(model_or_config: Any) -> int:
    config = getattr(model_or_config, "config", model_or_config)
    return int(_text_config(config).hidden_size)


def target_config_hash(model_or_config: Any) -> str:
    """Hash of the target's config, minus where/how it was saved: same architecture, same hash."""
    config = getattr(model_or_config, "config", model_or_config)
    data = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    return canonical_hash({k: v for k, v in data.items() if k not in _VOLATILE_CONFIG_KEYS})


def auto_layers(num_layers: int, count: int = 5) -> list[int]:
    """`count` ids spread over the depth like the reference configs (36 → 1,9,17,25,33; 40 → 1,10,…,37)."""
    start, end = 1, num_layers - 3
    if count > 1 and end - start >= count - 1:
        span = end - start
        return [int(round(start + i * span / (count - 1))) for i in range(count)]
    # Shallow targets: spread over every layer instead.
    count = min(count, num_layers)
    if count == 1:
        return [num_layers - 1]
    return sorted({int(round(i * (num_layers - 1) / (count - 1))) for i in range(count)})


def resolve_layers(spec: str | list[int] | None, num_layers: int) -> list[int]:
    """Parse `--layers` ('auto', '1,9,17', a list, or []/None for auto) and check it against the target."""
    if spec is None or spec == [] or (isinstance(spec, str) and spec.strip().lower() in ("", "auto")):
        return auto_layers(num_layers)
    if isinstance(spec, str):
        try:
            layers = [int(p) for p in spec.split(",") if p.strip()]
        except ValueError:
            raise DsparkError(f"--layers {spec!r}: expected 'auto' or comma-separated integers.") from None
    else:
        layers = [int(p) for p in spec]
    if any(b <= a for a, b in zip(layers, layers[1:], strict=False)):
        raise DsparkError(f"--layers {layers}: ids must be strictly increasing.")
    bad = [i for i in layers if not 0 <= i < num_layers]
    if bad:
        raise DsparkError(f"--layers: id {bad[0]} is out of range; the target has {num_layers} layers "
                          f"(valid ids 0..{num_layers - 1}).")
    return layers


def _base_model(model: Any) -> Any:
    """The decoder without lm_head: a forward there never materialises [T, vocab] logits."""
    base = getattr(model, "base_model_prefix", None)
    inner = getattr(model, base, None) if base else None
    return inner if inner is not None else model.get_decoder()


@dataclass
class Capture:
    """Features of one forward: `hidden` [B, T, m*d], `final` [B, T, d], optional KV cache."""

    hidden: torch.Tensor
    final: torch.Tensor
    past_key_values: Any = None


def _cache_kwarg(base: Any) -> str:
    """Transformers 5 renamed `past_key_values` to `cache`; accept either."""
    import inspect

    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"


@torch.inference_mode()
def capture_batch(model: Any, input_ids: torch.Tensor, layers: list[int],
                  attention_mask: torch.Tensor | None = None, past_key_values: Any = None,
                  use_cache: bool = False) -> Capture:
    """Forward a [B, T] batch; return the requested layers concatenated and the final normed state.

    Bit-exact against a single-sequence forward only for unpadded batches (equal lengths): padding
    changes the attention kernels' reduction order. `cache build` therefore batches equal lengths.
    """
    device = next(model.parameters()).device
    base = _base_model(model)
    kwargs: dict[str, Any] = {"input_ids": input_ids.to(device), "use_cache": use_cache,
                              "output_hidden_states": True}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask.to(device)
    if past_key_values is not None:
        kwargs[_cache_kwarg(base)] = past_key_values
    out = base(**kwargs)
    states = out.hidden_states  # num_layers + 1 tensors of [B, T, d]
    hidden = torch.cat([states[i + 1] for i in layers], dim=-1)  # [B, T, m*d]
    cache = None
    if use_cache:
        cache = out["cache"] if "cache" in out.keys() else out.past_key_values
    return Capture(hidden=hidden, final=out.last_hidden_state, past_key_values=cache)


def capture_layers(model: Any, input_ids: torch.Tensor | list[int], layers: list[int]
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence [T] → (hidden_states [T, m*d], final_hidden [T, d]) in the model's dtype/device."""
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]  # [1, T]
    cap = capture_batch(model, ids, layers)
    return cap.hidden[0], cap.final[0]


def answer_sample(model: Any, sample_id: str, prompt_ids: list[int], answer_ids: list[int],
                  eos_id: int, layers: list[int]) -> dict[str, Any]:
    """prompt + answer + eos → one training sample in the cache reader's format, without a cache.

    Supervised (loss_mask) on the answer and its eos only, features stored as bf16 as `cache build`
    stores them; what self-distillation in benchmarks and test fixtures feeds the trainer.
    """
    ids = prompt_ids + answer_ids + [eos_id]
    hidden, final = capture_layers(model, ids, layers)
    mask = torch.tensor([0] * len(prompt_ids) + [1] * (len(answer_ids) + 1), dtype=torch.bool)
    return {"sample_id": sample_id, "input_ids": torch.tensor(ids), "loss_mask": mask,
            "hidden_states": hidden.to(torch.bfloat16),
            "final_hidden": (final * mask[:, None]).to(torch.bfloat16)}


def capture_step(model: Any, new_ids: torch.Tensor | list[int], layers: list[int],
                 past_key_values: Any = None) -> Capture:
    """Incremental capture for decoding: feed only new tokens, keep the KV cache (eval's helper)."""
    ids = torch.as_tensor(new_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids[None]  # [1, t]
    if past_key_values is None:
        from transformers import DynamicCache

        past_key_values = DynamicCache(config=model.config)
    cap = capture_batch(model, ids, layers, past_key_values=past_key_values, use_cache=True)
    return Capture(hidden=cap.hidden[0], final=cap.final[0], past_key_values=cap.past_key_values)
