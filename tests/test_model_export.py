"""The serving folder (DESIGN.md §3): exact keys and config fields, reload, convention pairing."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.drafter import drafter_config, make_samples
from safetensors.torch import load as st_load

from dspark_cli import storage
from dspark_cli.errors import DsparkError
from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.model.export import export_drafter, load_drafter
from dspark_cli.model.frozen import attach_frozen

LAYER_KEYS = ["input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
              "post_attention_layernorm.weight", "self_attn.k_norm.weight", "self_attn.k_proj.weight",
              "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.q_proj.weight",
              "self_attn.v_proj.weight"]


def build(target, **model) -> DSparkDrafter:
    torch.manual_seed(1)
    drafter = DSparkDrafter(drafter_config(target, **model))
    attach_frozen(drafter, str(target))
    if drafter.markov_head is not None:
        torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.5)
    return drafter.eval()


def expected_keys(num_layers: int, markov: bool = True, confidence: bool = True,
                  kind: str = "vanilla") -> set[str]:
    keys = {f"layers.{i}.{k}" for i in range(num_layers) for k in LAYER_KEYS}
    keys |= {"fc.weight", "hidden_norm.weight", "norm.weight"}
    if markov:
        keys |= {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight"}
    if kind == "gated":
        keys |= {"markov_head.gate_proj.weight", "markov_head.gate_proj.bias"}
    if kind == "rnn":
        keys |= {"markov_head.joint_proj.weight", "markov_head.joint_proj.bias"}
    if confidence:
        keys |= {"confidence_head.proj.weight", "confidence_head.proj.bias"}
    return keys


def logits_of(drafter, sample, anchor):
    block = drafter.draft_block(sample.hidden_states[:anchor], int(sample.input_ids[anchor]), anchor,
                                temperature=1.0, generator=torch.Generator().manual_seed(3))
    return block


@pytest.fixture(scope="module")
def sample(tiny_qwen3_target):
    return make_samples(tiny_qwen3_target, n=1)[0]


def test_dspark_export_has_exact_keys_and_fields(tiny_qwen3_target, tmp_path):
    drafter = build(tiny_qwen3_target)
    export_drafter(drafter, str(tmp_path))
    tensors = st_load((tmp_path / "model.safetensors").read_bytes())
    assert set(tensors) == expected_keys(2)
    assert all(t.dtype == torch.bfloat16 for t in tensors.values())
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == 4 and cfg["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert cfg["num_target_layers"] == 36 and cfg["mask_token_id"] == 384
    assert cfg["markov_rank"] == 16 and cfg["markov_head_type"] == "vanilla"
    assert cfg["enable_confidence_head"] is True and cfg["confidence_head_with_markov"] is True
    assert cfg["sample_from_anchor"] is True
    assert cfg["dflash_config"] == {"block_size": 4, "target_layer_ids": [1, 9, 17, 25, 33],
                                    "mask_token_id": 384}
    assert cfg["num_hidden_layers"] == 2 and cfg["hidden_size"] == 32 and cfg["head_dim"] == 8
    assert "speculators_model_type" not in cfg
    # SGLang merges a top-level dspark_config into its DSpark settings: our data lives elsewhere.
    assert "dspark_config" not in cfg and cfg["dspark_cli_config"]["markov_head_type"] == "vanilla"


@pytest.mark.parametrize("kind,extra", [
    ("gated", {"markov_head.gate_proj.weight": (16, 32 + 16), "markov_head.gate_proj.bias": (16,)}),
    ("rnn", {"markov_head.joint_proj.weight": (3 * 16, 2 * 16 + 32), "markov_head.joint_proj.bias": (48,)})])
def test_gated_and_rnn_heads_export_deepspec_names_and_shapes(tiny_qwen3_target, tmp_path, kind, extra):
    drafter = build(tiny_qwen3_target, markov_head_type=kind)
    export_drafter(drafter, str(tmp_path), dtype="float32")
    tensors = st_load((tmp_path / "model.safetensors").read_bytes())
    assert set(tensors) == expected_keys(2, kind=kind)
    assert {k: tuple(tensors[k].shape) for k in extra} == extra
    assert tensors["markov_head.markov_w1.weight"].shape == (drafter.config.vocab_size, 16)
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert json.loads((tmp_path / "config.json").read_text())["markov_head_type"] == kind


def test_anchor_first_without_markov_exports_a_zero_head(tiny_qwen3_target, tmp_path, sample):
    """Engines need a Markov head on Qwen3DSparkModel; a rank-1 zero head adds exactly nothing."""
    drafter = build(tiny_qwen3_target, markov_head_type="none", enable_confidence_head=False,
                    confidence_head_with_markov=False)
    export_drafter(drafter, str(tmp_path), dtype="float32")
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3DSparkModel"]
    assert cfg["markov_head_type"] == "vanilla" and cfg["markov_rank"] == 1
    assert cfg["dspark_cli_config"]["markov_head_type"] == "none"
    tensors = st_load((tmp_path / "model.safetensors").read_bytes())
    assert set(tensors) == expected_keys(2, confidence=False)
    for key in ("markov_head.markov_w1.weight", "markov_head.markov_w2.weight"):
        assert tensors[key].shape == (drafter.config.vocab_size, 1) and not tensors[key].any()
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    reloaded = load_drafter(str(tmp_path))
    assert reloaded.markov_head is None
    assert torch.allclose(logits_of(drafter, sample, anchor).probs, logits_of(reloaded, sample, anchor).probs,
                          atol=1e-6)


def test_exports_of_the_first_release_still_load(tiny_qwen3_target, tmp_path, sample):
    """Old exports kept DrafterConfig under `dspark_config`; they reload unchanged."""
    drafter = build(tiny_qwen3_target)
    export_drafter(drafter, str(tmp_path), dtype="float32")
    path = tmp_path / "config.json"
    cfg = json.loads(path.read_text())
    cfg["dspark_config"] = cfg.pop("dspark_cli_config")
    path.write_text(json.dumps(cfg))
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 2
    assert torch.equal(logits_of(load_drafter(str(tmp_path)), sample, anchor).tokens,
                       logits_of(drafter, sample, anchor).tokens)


def test_old_gated_checkpoints_convert_exactly_and_old_rnn_ones_are_refused(tiny_qwen3_target, tmp_path):
    """The first release's gated head σ(G·h + g) ⊙ e is gate_proj = [G | 0]; its GRU has no equivalent."""
    from safetensors.torch import save as st_save

    from dspark_cli.model.export import save_weights

    drafter = build(tiny_qwen3_target, markov_head_type="gated")
    save_weights(drafter, str(tmp_path / "old"))
    path = tmp_path / "old" / "model.safetensors"
    tensors = st_load(path.read_bytes())
    del tensors["markov_head.gate_proj.weight"], tensors["markov_head.gate_proj.bias"]
    gen = torch.Generator().manual_seed(5)
    G, g = torch.randn(16, 32, generator=gen), torch.randn(16, generator=gen)
    tensors["markov_head.gate.weight"], tensors["markov_head.gate.bias"] = G, g
    path.write_bytes(st_save(tensors))
    head = load_drafter(str(tmp_path / "old")).markov_head
    prev, hidden = torch.tensor([[3, 7, 11]]), torch.randn(1, 3, 32, generator=gen)
    old = torch.sigmoid(hidden @ G.T + g) * tensors["markov_head.markov_w1.weight"][prev]
    assert torch.allclose(head.features(prev, hidden), old, atol=1e-6)

    rnn = build(tiny_qwen3_target, markov_head_type="rnn")
    save_weights(rnn, str(tmp_path / "old-rnn"))
    path = tmp_path / "old-rnn" / "model.safetensors"
    tensors = {k: v for k, v in st_load(path.read_bytes()).items() if "joint_proj" not in k}
    tensors["markov_head.rnn.weight_ih"] = torch.zeros(48, 16)
    path.write_bytes(st_save(tensors))
    with pytest.raises(DsparkError, match="old GRU form"):
        load_drafter(str(tmp_path / "old-rnn"))


def test_reload_reproduces_logits(tiny_qwen3_target, tmp_path, sample):
    drafter = build(tiny_qwen3_target, markov_head_type="rnn")
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    before = logits_of(drafter, sample, anchor)
    export_drafter(drafter, str(tmp_path / "fp32"), dtype="float32")
    after = logits_of(load_drafter(str(tmp_path / "fp32")), sample, anchor)
    assert torch.equal(before.tokens, after.tokens)
    assert torch.allclose(before.probs, after.probs, atol=1e-6)
    assert torch.allclose(before.confidences, after.confidences, atol=1e-6)
    export_drafter(drafter, str(tmp_path / "bf16"))  # the serving dtype: close, not identical
    bf16 = logits_of(load_drafter(str(tmp_path / "bf16")), sample, anchor)
    assert (before.probs - bf16.probs).abs().sum(-1).max() < 0.05


def test_include_embeddings_and_memory_url(tiny_qwen3_target, memory_url, sample):
    drafter = build(tiny_qwen3_target)
    url = storage.join(memory_url, "export")
    export_drafter(drafter, url, include_embeddings=True, dtype="float32")
    tensors = st_load(storage.read_bytes(storage.join(url, "model.safetensors")))
    assert set(tensors) == expected_keys(2) | {"embed_tokens.weight", "lm_head.weight"}
    # No target needed to reload: the frozen rows are in the folder.
    reloaded = load_drafter(url, target="/nonexistent")
    assert torch.equal(reloaded.lm_head.weight, drafter.lm_head.weight)


def test_fill_in_baseline_exports_as_dflash(tiny_qwen3_target, tmp_path):
    drafter = build(tiny_qwen3_target, block_convention="fill_in", markov_head_type="none",
                    enable_confidence_head=False)
    export_drafter(drafter, str(tmp_path))
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["sample_from_anchor"] is False
    assert cfg["block_size"] == 5  # anchor slot + γ, as DFlashDraftModel counts it
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert cfg["dflash_config"]["mask_token_id"] == 384
    assert set(st_load((tmp_path / "model.safetensors").read_bytes())) == expected_keys(2, False, False)


def test_tied_k_norm_exports_one_weight_under_every_layers_name(tiny_qwen3_target, tmp_path, sample):
    """model.tie_k_norm (vLLM-CPU serves context keys with layer 0's k_norm): one trained weight,
    written under each layer's name as engines load it, and reloaded still tied."""
    drafter = build(tiny_qwen3_target, block_convention="fill_in", markov_head_type="none",
                    enable_confidence_head=False, tie_k_norm=True)
    norms = [layer.self_attn.k_norm.weight for layer in drafter.layers]
    assert norms[0] is norms[1]
    with torch.no_grad():
        norms[0].normal_(1.0, 0.3)
    loss = drafter.layers[1].self_attn.k_norm(torch.randn(3, drafter.config.head_dim)).sum()
    loss.backward()
    assert norms[0].grad is not None  # layer 1's use trains the one shared weight
    export_drafter(drafter, str(tmp_path), dtype="float32")
    tensors = st_load((tmp_path / "model.safetensors").read_bytes())
    assert set(tensors) == expected_keys(2, False, False)
    for i in range(2):
        assert torch.equal(tensors[f"layers.{i}.self_attn.k_norm.weight"], norms[0].detach())
    reloaded = load_drafter(str(tmp_path))
    assert reloaded.config.tie_k_norm
    assert reloaded.layers[0].self_attn.k_norm is reloaded.layers[1].self_attn.k_norm
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    assert torch.allclose(logits_of(drafter, sample, anchor).probs, logits_of(reloaded, sample, anchor).probs,
                          atol=1e-6)


def test_wrong_pairings_are_refused(tiny_qwen3_target, tmp_path):
    anchor_first = build(tiny_qwen3_target)
    with pytest.raises(DsparkError, match="cannot be exported as DFlashDraftModel"):
        export_drafter(anchor_first, str(tmp_path / "a"), architecture="DFlashDraftModel")
    fill_in = build(tiny_qwen3_target, block_convention="fill_in", markov_head_type="none",
                    enable_confidence_head=False)
    with pytest.raises(DsparkError, match="cannot be exported as Qwen3DSparkModel"):
        export_drafter(fill_in, str(tmp_path / "b"), architecture="Qwen3DSparkModel")
    with_heads = build(tiny_qwen3_target, block_convention="fill_in")
    with pytest.raises(DsparkError, match="no Markov or confidence head"):
        export_drafter(with_heads, str(tmp_path / "c"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_export_cli(tiny_qwen3_target, tmp_path):
    from dspark_cli.model.export import save_weights

    drafter = build(tiny_qwen3_target)
    save_weights(drafter, str(tmp_path / "ckpt"))
    from dspark_cli.cli import main

    main(["export", str(tmp_path / "ckpt"), str(tmp_path / "out"), "--include-embeddings"])
    assert set(st_load((tmp_path / "out" / "model.safetensors").read_bytes())) == (
        expected_keys(2) | {"embed_tokens.weight", "lm_head.weight"})
    with pytest.raises(SystemExit) as exit_info:
        main(["export", str(tmp_path / "ckpt"), str(tmp_path / "bad"), "--architecture", "DFlashDraftModel"])
    assert exit_info.value.code == 2
    from fixtures.cli import assert_user_error, run_dspark

    failed = run_dspark("export", str(tmp_path / "ckpt"), str(tmp_path / "d2t"), "--d2t")
    assert_user_error(failed, "--d2t", "whole vocabulary")
    assert not (tmp_path / "d2t" / "config.json").exists()


def reduced(target, size: int = 40) -> DSparkDrafter:
    """A drafter whose draft vocabulary is `size` scattered target ids."""
    drafter = build(target, draft_vocab_size=size)
    ids = torch.randperm(drafter.config.vocab_size, generator=torch.Generator().manual_seed(4))[:size]
    drafter.draft_token_ids.copy_(ids.sort().values)
    return drafter


def test_with_d2t_a_reduced_draft_vocabulary_exports_vllms_form_and_reloads(tiny_qwen3_target, tmp_path,
                                                                             sample):
    """lm_head [N, d] (the target's rows) and d2t (target = draft + d2t[draft]) beside the usual keys;
    the folder reloads to the same drafter, whose drafts only ever hold draft-vocabulary tokens."""
    drafter = reduced(tiny_qwen3_target)
    ids = drafter.draft_token_ids
    config = export_drafter(drafter, str(tmp_path / "x"), dtype="float32", d2t=True)
    assert config["draft_vocab_size"] == 40 and config["vocab_size"] == drafter.config.vocab_size
    tensors = st_load((tmp_path / "x" / "model.safetensors").read_bytes())
    assert set(tensors) == expected_keys(2) | {"lm_head.weight", "d2t"}
    assert tensors["d2t"].dtype == torch.int64
    assert torch.equal(torch.arange(40) + tensors["d2t"], ids)
    assert torch.equal(tensors["lm_head.weight"], drafter.lm_head.weight[ids])
    assert tensors["markov_head.markov_w2.weight"].shape == (40, drafter.config.markov_rank)
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    before = logits_of(drafter, sample, anchor)
    reloaded = load_drafter(str(tmp_path / "x"))
    assert torch.equal(reloaded.draft_token_ids, ids)
    assert torch.equal(reloaded.lm_head.weight, drafter.lm_head.weight)  # the whole head, from the target
    after = logits_of(reloaded, sample, anchor)
    assert torch.equal(before.tokens, after.tokens) and torch.allclose(before.probs, after.probs, atol=1e-6)
    assert torch.isin(before.tokens, ids).all()
    outside = torch.ones(drafter.config.vocab_size, dtype=torch.bool)
    outside[ids] = False
    assert float(before.probs[:, outside].sum()) == 0.0  # p_d is zero outside the draft vocabulary


def test_a_reduced_draft_equals_the_full_draft_restricted_to_its_tokens(tiny_qwen3_target, sample):
    """The same weights drafting over N rows give the softmax of the full drafter's logits on those
    N tokens (Markov bias included), slot by slot."""
    small = reduced(tiny_qwen3_target)
    ids = small.draft_token_ids
    full = build(tiny_qwen3_target)
    state = {k: v for k, v in small.state_dict().items() if k != "draft_token_ids"}
    w2 = torch.zeros_like(full.markov_head.markov_w2.weight)
    w2[ids] = state.pop("markov_head.markov_w2.weight")
    full.load_state_dict({**state, "markov_head.markov_w2.weight": w2})
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    ctx, tok = sample.hidden_states[:anchor], int(sample.input_ids[anchor])
    context = full.new_context()
    context.add_row()
    full.extend_context(context, [ctx])
    b = small.draft_block(ctx, tok, anchor, temperature=1.0, generator=torch.Generator().manual_seed(5))
    hidden = full.draft_slots(full.backbone(full.block_inputs(torch.tensor([tok])),
                                            anchor + torch.arange(full.config.block_inputs)[None],
                                            context.layer_kv(), None))[0]
    prev = torch.cat([torch.tensor([tok]), b.tokens[:-1]])
    z = full.markov_head.features(prev[None], hidden[None])[0]
    logits = full.lm_head(hidden) + full.markov_head.bias(z)
    expected = torch.softmax(logits[:, ids], -1)
    assert torch.allclose(b.probs[:, ids], expected, atol=1e-5)


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_by_default_a_reduced_vocabulary_is_widened_to_one_both_engines_serve_identically(
        tiny_qwen3_target, tmp_path, sample, kind):
    """The default export is a plain full-vocabulary drafter of rank r + 1 (what SGLang builds from
    config.json): rebuilt as such, it drafts exactly the reduced drafter's distribution (zero outside
    the draft vocabulary) with the same confidences; load_drafter gives the reduced drafter back."""
    from dspark_cli.model.config import DrafterConfig

    drafter = build(tiny_qwen3_target, draft_vocab_size=40, markov_head_type=kind)
    ids = torch.randperm(drafter.config.vocab_size, generator=torch.Generator().manual_seed(4))[:40]
    ids = ids.sort().values
    drafter.draft_token_ids.copy_(ids)
    torch.nn.init.normal_(drafter.confidence_head.proj.weight, std=0.5)
    config = export_drafter(drafter, str(tmp_path / "w"), dtype="float32")
    r = drafter.config.markov_rank
    assert "draft_vocab_size" not in config and config["markov_rank"] == r + 1
    tensors = st_load((tmp_path / "w" / "model.safetensors").read_bytes())
    assert set(tensors) == expected_keys(2, kind=kind)
    plain_config = {**drafter.config.to_dict(), "draft_vocab_size": 0, "markov_rank": r + 1}
    plain = DSparkDrafter(DrafterConfig.from_dict(plain_config))
    attach_frozen(plain, str(tiny_qwen3_target))
    plain.load_state_dict(tensors, strict=False)
    plain.eval()
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    ours, theirs = logits_of(drafter, sample, anchor), logits_of(plain, sample, anchor)
    assert torch.equal(ours.tokens, theirs.tokens)
    assert torch.allclose(ours.probs, theirs.probs, atol=1e-6)
    assert torch.allclose(ours.confidences, theirs.confidences, atol=1e-6)
    back = load_drafter(str(tmp_path / "w"))
    assert torch.equal(back.draft_token_ids, ids)
    for name, value in drafter.state_dict().items():
        assert torch.equal(back.state_dict()[name], value), name

