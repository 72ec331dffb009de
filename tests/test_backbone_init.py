"""train.backbone_init = "target": the drafter starts from the target's own layers, checked against
Transformers' layer modules on the target's real features."""

from __future__ import annotations

import pytest
import torch
from fixtures.cli import REPO, assert_user_error, run_dspark
from fixtures.drafter import drafter_config, make_samples
from transformers import AutoModelForCausalLM, GemmaConfig, GemmaForCausalLM

from dspark_cli.config import load_config
from dspark_cli.errors import ConfigError
from dspark_cli.model.backbone_init import init_backbone_from_target, source_layers
from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.model.frozen import attach_frozen


def _drafter(target, layers, **model) -> DSparkDrafter:
    torch.manual_seed(0)
    drafter = DSparkDrafter(drafter_config(target, layers=layers, **model))
    attach_frozen(drafter, str(target))
    return drafter.float()


def _target_inputs(target, layers):
    """One real sequence: the target, its hidden states, and the drafter's concatenated features."""
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    ids = torch.arange(3, 23)[None]
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states
    return model, states, torch.cat([states[i + 1][0] for i in layers], dim=-1)


def _target_keys(model, layer: int, x: torch.Tensor, positions: torch.Tensor, qk_norm: bool):
    """Transformers' own keys/values of `layer` for input x [1, T, d] (rotated keys, as cached)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    attn = model.model.layers[layer].self_attn
    h = model.model.layers[layer].input_layernorm(x)
    shape = (*h.shape[:-1], -1, attn.head_dim)
    k = attn.k_proj(h).view(shape)
    k = (attn.k_norm(k) if qk_norm else k).transpose(1, 2)
    v = attn.v_proj(h).view(shape).transpose(1, 2)
    cos, sin = model.model.rotary_emb(h, positions)
    _, k = apply_rotary_pos_emb(k, k, cos, sin)
    return k, v


@pytest.mark.parametrize(("targets", "deepest", "n", "expected"),
                         [(36, 33, 5, [31, 32, 33, 34, 35]), (30, 27, 2, [28, 29]), (36, 25, 2, [26, 27])])
def test_source_layers_follow_the_deepest_captured_one(targets, deepest, n, expected):
    assert source_layers(targets, deepest, n) == expected


def test_more_draft_layers_than_the_target_has_is_refused():
    with pytest.raises(ConfigError, match="copies 5 target layers, but the target has 4"):
        source_layers(4, 1, 5)


def test_qwen3_first_layer_context_is_the_next_target_layers_own(tiny_qwen3_target):
    layers = [1, 9, 17]
    drafter = _drafter(tiny_qwen3_target, layers)
    done = init_backbone_from_target(drafter, str(tiny_qwen3_target), [])
    assert done == {"source_layers": [18, 19], "model_type": "qwen3", "qk_norm": "copied"}
    model, states, features = _target_inputs(tiny_qwen3_target, layers)
    positions = torch.arange(features.shape[0])[None]
    with torch.no_grad():
        k, v = drafter.context_kv(drafter.fuse_context(features)[None], positions)[0]
        ref_k, ref_v = _target_keys(model, 18, states[18], positions, qk_norm=True)
    torch.testing.assert_close(k, ref_k, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(v, ref_v, atol=1e-5, rtol=1e-4)
    target_19 = model.model.layers[19]
    assert torch.equal(drafter.layers[1].mlp.down_proj.weight, target_19.mlp.down_proj.weight)
    assert torch.equal(drafter.layers[1].self_attn.q_norm.weight, target_19.self_attn.q_norm.weight)
    assert torch.equal(drafter.norm.weight, model.model.norm.weight)


def test_llama_qk_norm_gains_are_the_targets_own_rms(tiny_llama_target):
    layers = [1, 3]
    drafter = _drafter(tiny_llama_target, layers, tie_k_norm=False)
    samples = make_samples(tiny_llama_target, n=3, layers=layers)
    done = init_backbone_from_target(drafter, str(tiny_llama_target), samples)
    assert done["source_layers"] == [4, 5] and done["model_type"] == "llama"
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_target, dtype=torch.float32).eval()
    features = torch.cat([s.hidden_states[:, -drafter.config.hidden_size:] for s in samples]).float()
    for i, source in enumerate([4, 5]):
        layer = model.model.layers[source]
        with torch.no_grad():
            k = layer.self_attn.k_proj(layer.input_layernorm(features))
        k = k.unflatten(-1, (-1, layer.self_attn.head_dim))
        expected = k.pow(2).mean(-1).sqrt().mean()
        gain = drafter.layers[i].self_attn.k_norm.weight
        assert torch.allclose(gain, expected.expand_as(gain), rtol=1e-4)
        assert done["qk_norm"]["k_gain"][i] == pytest.approx(float(expected), abs=1e-4)
    with pytest.raises(ConfigError, match="needs cached features"):
        init_backbone_from_target(_drafter(tiny_llama_target, layers), str(tiny_llama_target), [])


def test_a_gemma_target_is_refused_not_copied_wrongly(tmp_path):
    config = GemmaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    GemmaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    from dspark_cli.model.config import DrafterConfig

    drafter = DSparkDrafter(DrafterConfig.from_target(config, layers=[1], mask_token_id=63,
                                                      model_settings={"num_draft_layers": 1},
                                                      target_model=str(tmp_path)))
    with pytest.raises(ConfigError, match="supports llama, mistral, qwen2, qwen3 targets, not 'gemma'"):
        init_backbone_from_target(drafter, str(tmp_path), [])


def test_config_checks_the_key_and_its_conflict_with_the_output_gain():
    with pytest.raises(ConfigError, match=r"train\.backbone_init.*random or target.*'layers'"):
        load_config(None, ["train.backbone_init=layers"])
    with pytest.raises(ConfigError, match=r"train\.init_output_gain.*must stay 1 with backbone_init"):
        load_config(None, ["train.backbone_init=target", "train.init_output_gain=auto"])
    assert load_config(None, ["train.backbone_init=target"]).train.backbone_init == "target"


def test_a_bad_value_is_one_line_through_the_entry_point():
    proc = run_dspark("pipeline", "show", "pipelines/smollm2-135m.toml",
                      "--set", "train.backbone_init=layers", cwd=REPO)
    assert_user_error(proc, "train.backbone_init", "random or target")
