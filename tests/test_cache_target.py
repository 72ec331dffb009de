"""Target helpers shared with eval: loading, layer ids, one-shot and incremental capture."""

from __future__ import annotations

import pytest
import torch

from dspark_cli.cache.target import (
    auto_layers,
    capture_layers,
    capture_step,
    load_target,
    num_target_layers,
    target_config_hash,
)
from dspark_cli.errors import DsparkError


def test_capture_matches_hidden_states_and_the_final_norm(tiny_llama_target):
    model, _ = load_target(str(tiny_llama_target), "float32", "cpu")
    assert num_target_layers(model) == 6 and not any(p.requires_grad for p in model.parameters())
    layers = auto_layers(6)
    ids = torch.arange(3, 40)
    hidden, final = capture_layers(model, ids, layers)
    with torch.no_grad():
        out = model(ids[None], output_hidden_states=True)
    assert hidden.shape == (37, 32 * len(layers)) and final.shape == (37, 32)
    assert torch.equal(hidden[:, :32], out.hidden_states[layers[0] + 1][0])
    assert torch.allclose(model.lm_head(final), out.logits[0], atol=1e-5)


def test_incremental_capture_follows_the_full_forward(tiny_llama_target):
    model, _ = load_target(str(tiny_llama_target), "float32", "cpu")
    ids = torch.arange(3, 40)
    full_hidden, full_final = capture_layers(model, ids, [1, 4])
    first = capture_step(model, ids[:30], [1, 4])
    second = capture_step(model, ids[30:], [1, 4], first.past_key_values)
    assert torch.allclose(torch.cat([first.hidden, second.hidden]), full_hidden, atol=1e-4)
    assert torch.allclose(torch.cat([first.final, second.final]), full_final, atol=1e-4)


def test_config_hash_ignores_where_the_model_was_saved(tiny_llama_target, tiny_qwen3_target):
    from transformers import AutoConfig

    a = AutoConfig.from_pretrained(tiny_llama_target)
    b = AutoConfig.from_pretrained(tiny_llama_target)
    b._name_or_path = "/elsewhere"
    assert target_config_hash(a) == target_config_hash(b)
    assert target_config_hash(a) != target_config_hash(AutoConfig.from_pretrained(tiny_qwen3_target))


def test_missing_target_is_a_user_error(tmp_path):
    with pytest.raises(DsparkError, match="cannot load it"):
        load_target(str(tmp_path / "nope"), "float32", "cpu")
    with pytest.raises(DsparkError, match="no target model"):
        load_target("", "float32", "cpu")
