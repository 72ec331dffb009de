"""`dspark cache estimate`: the cache's size before building it (tokenizer and config only, no weights).

Renders (a sample of) the responses exactly as `build` would, counts tokens and supervised tokens,
and applies the layout's bytes per token. It also says what training online (`dspark train
--online`, no cache) would trade: these bytes saved, for one target forward per training
sample per epoch (the cache pays that forward once, at build time). Compression ratios are the
ones measured on real SmolLM2-135M states (`make bench-cache`, docs/cache.md); the uncompressed
figure is exact.
"""

from __future__ import annotations

from typing import Any

from .. import manifest
from ..config import PipelineConfig
from ..target.files import hidden_size, load_config, num_layers
from ..target.layers import resolve_layers
from . import RESPONSES_HINT, store

#: Measured stored/raw ratios of the hidden-state arrays (see docs/cache.md).
EXPECTED_RATIO = {("bf16", "blosc"): 1 / 1.30, ("bf16", "zstd"): 1 / 1.24, ("bf16", "none"): 1.0,
                  ("fp8", "blosc"): 1 / 1.18, ("fp8", "zstd"): 1 / 1.18, ("fp8", "none"): 1.0}


def estimate_cache(cfg: PipelineConfig, responses_url: str, sample: int = 2000) -> dict[str, Any]:
    from ..data.io import row_index

    t = cfg.target
    manifest.require_artifact(responses_url, "data.regen", "--responses", RESPONSES_HINT)
    index = row_index(responses_url)  # the local input first: offline first
    total_rows = index.num_rows
    config = load_config(t.model, t.revision, t.trust_remote_code)
    layers = resolve_layers(t.layers, num_layers(config))
    # Torch and Transformers load only now, once the inputs are known good (~2 s).
    from ..target.model import load_tokenizer
    from ..target.samples import INPUT_COLUMNS, render_rows

    rows = index.read(0, sample, INPUT_COLUMNS)
    m, d = len(layers), hidden_size(config)
    tokenizer = load_tokenizer(t.model, t.revision, t.trust_remote_code)
    samples, skipped, _ = render_rows(tokenizer, rows, cfg.cache.max_length, cfg.cache.min_loss_tokens)
    scale = total_rows / max(1, len(rows))
    tokens = int(sum(len(s.input_ids) for s in samples) * scale)
    loss = int(sum(s.num_loss_tokens for s in samples) * scale)
    raw = store.layout_bytes(tokens, loss, m, d, cfg.cache.storage_dtype)
    expected = int(raw * EXPECTED_RATIO[(cfg.cache.storage_dtype, cfg.cache.compression)])
    reference = store.reference_bytes(tokens, m, d)
    train = [s for s in samples if s.split == "train"]
    return {"rows": total_rows, "rendered_rows": len(rows), "samples": int(len(samples) * scale),
            "skipped": {k: int(v * scale) for k, v in skipped.items()}, "tokens": tokens,
            "loss_tokens": loss, "layers": layers, "hidden_size": d, "storage_dtype": cfg.cache.storage_dtype,
            "compression": cfg.cache.compression, "uncompressed_bytes": raw, "expected_bytes": expected,
            "reference_bytes": reference, "vs_reference": round(expected / max(1, reference), 3),
            "exact": len(rows) == total_rows,
            # online training: no cache bytes; the target's forward over every training sample, each epoch
            "online_saves_bytes": expected, "online_target_forwards_per_epoch": int(len(train) * scale),
            "online_target_tokens_per_epoch": int(sum(len(s.input_ids) for s in train) * scale)}
