"""The stacked-heads decoding attention (target/decode_attention.py) against Transformers' own SDPA
path, on a real (tiny, grouped-query) Qwen3 in float32: same logits, and the stacked path taken."""

from __future__ import annotations

import pytest
import torch

from dspark_cli.decode.batch import TargetBatch
from dspark_cli.target import decode_attention
from dspark_cli.target.kv import new_cache
from dspark_cli.target.model import load_target


@pytest.fixture()
def target(tiny_qwen3_target):
    model, _ = load_target(str(tiny_qwen3_target), "float32", "cpu")
    assert model.config._attn_implementation == decode_attention.NAME  # load_target installs it
    return model


@pytest.fixture()
def stacked_calls(monkeypatch):
    """(query tokens, mask given) of every call that took the stacked path."""
    calls: list[tuple[int, bool]] = []
    real = decode_attention._stackable

    def spy(query, key, mask, groups, dropout, kwargs):
        ok = real(query, key, mask, groups, dropout, kwargs)
        if ok:
            calls.append((query.shape[2], mask is not None))
        return ok

    monkeypatch.setattr(decode_attention, "_stackable", spy)
    return calls


def _decode(model, steps: list[list[int]]) -> torch.Tensor:
    """A prompt, then the given steps through one KV cache: every step's logits, concatenated."""
    cache = new_cache(model.config)
    prompt = torch.arange(3, 40)[None]
    out = [model(input_ids=prompt, cache=cache, use_cache=True).logits[0, -1:]]
    for ids in steps:
        out.append(model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits[0])
    return torch.cat(out)


@torch.inference_mode()
def test_one_sequence_steps_match_transformers_sdpa(target, stacked_calls):
    steps = [[5], [6, 7, 8], [9], [10, 11]]
    ours = _decode(target, steps)
    assert (1, False) in stacked_calls  # one token, no mask: stacked
    assert any(q > 1 for q, _ in stacked_calls)  # a verification-sized step under a mask: stacked
    target.set_attn_implementation("sdpa")
    torch.testing.assert_close(ours, _decode(target, steps), rtol=0, atol=1e-5)


@torch.inference_mode()
def test_padded_rows_match_transformers_sdpa(target, stacked_calls):
    """Two requests of different lengths in one cache (left padding, a [R, T] mask), as eval's
    batched rounds run them: a one-token and a three-token step per row."""
    def run() -> list[torch.Tensor]:
        batch = TargetBatch(target, [1, 3])
        batch.add(list(range(3, 30)))
        batch.add(list(range(3, 12)))
        out = []
        for inputs, positions in (([[5], [6]], [27, 9]), ([[7, 8, 9], [10, 11]], [28, 10])):
            hidden, final = batch.forward(inputs, positions)
            out += [hidden, final]
            batch.commit([len(x) for x in inputs])
        return out

    ours = run()
    assert stacked_calls and all(masked for _, masked in stacked_calls)
    target.set_attn_implementation("sdpa")
    for a, b in zip(ours, run(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_a_prefill_and_other_implementations_keep_transformers_path(tiny_qwen3_target):
    q, k = torch.zeros(1, 4, 20, 8), torch.zeros(1, 2, 20, 8)
    assert not decode_attention._stackable(q, k, None, 2, 0.0, {})  # a causal prefill without a mask
    assert not decode_attention._stackable(q[:, :, :1], k, None, 2, 0.1, {})  # dropout
    assert not decode_attention._stackable(q[:, :, :1], k[:, :1], None, 2, 0.0, {})  # heads do not group
    per_head = torch.ones(1, 4, 1, 20, dtype=torch.bool)
    assert not decode_attention._stackable(q[:, :, :1], k, per_head, 2, 0.0, {})
    model, _ = load_target(str(tiny_qwen3_target), "float32", "cpu")
    model.set_attn_implementation("eager")
    assert not decode_attention.install(model) and model.config._attn_implementation == "eager"
