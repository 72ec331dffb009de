"""The drafter (contract 4): config from real targets, the attention rule, train/inference agreement."""

from __future__ import annotations

import pytest
import torch
from fixtures.drafter import LAYERS, drafter_config, make_samples

from dspark_cli.errors import ConfigError
from dspark_cli.model.attention import BlockLayout, dense_mask
from dspark_cli.model.config import DrafterConfig
from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.model.frozen import attach_frozen, load_embeddings
from dspark_cli.target.files import load_config
from dspark_cli.train.blocks import pack


@pytest.fixture(scope="module")
def samples(tiny_qwen3_target):
    return make_samples(tiny_qwen3_target, n=3)


def build(target, **model) -> DSparkDrafter:
    torch.manual_seed(0)
    drafter = DSparkDrafter(drafter_config(target, **model))
    attach_frozen(drafter, str(target))
    # Make the Markov/confidence heads non-trivial (W2 starts at zero).
    if drafter.markov_head is not None:
        torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.5)
    return drafter.eval()


class TestConfig:
    def test_sizes_come_from_the_target(self, tiny_qwen3_target, tiny_llama_target):
        q = drafter_config(tiny_qwen3_target)
        assert (q.hidden_size, q.num_attention_heads, q.num_key_value_heads, q.head_dim) == (32, 4, 2, 8)
        assert q.num_target_layers == 36 and q.vocab_size == 385 and q.mask_token_id == 384
        assert q.rope_parameters["rope_theta"] == 10000.0
        llama = drafter_config(tiny_llama_target, layers=[0, 2, 5])
        assert llama.num_target_layers == 6 and llama.target_layer_ids == [0, 2, 5]
        assert DrafterConfig.from_json(q.to_json()) == q

    def test_mask_token_must_be_a_row_of_the_embedding(self, tiny_qwen3_target):
        target_config = load_config(str(tiny_qwen3_target))
        with pytest.raises(ConfigError, match="mask_token_id 385 is not a row"):
            DrafterConfig.from_target(target_config, layers=LAYERS, mask_token_id=385)
        with pytest.raises(ConfigError, match="never pad/eos"):
            DrafterConfig.from_target(target_config, layers=LAYERS, mask_token_id=None)

    def test_layers_beyond_the_target_are_refused(self, tiny_llama_target):
        with pytest.raises(ConfigError, match="must be < the target's 6 layers"):
            drafter_config(tiny_llama_target, layers=[1, 6])

    def test_confidence_with_markov_needs_a_markov_head(self, tiny_qwen3_target):
        with pytest.raises(ConfigError, match="confidence_head_with_markov"):
            drafter_config(tiny_qwen3_target, markov_head_type="none")


def test_frozen_rows_are_the_targets_and_only_them(tiny_qwen3_target):
    from safetensors import safe_open

    drafter = build(tiny_qwen3_target)
    with safe_open(str(tiny_qwen3_target / "model.safetensors"), framework="pt") as f:
        assert torch.equal(drafter.embed_tokens.weight, f.get_tensor("model.embed_tokens.weight"))
        assert torch.equal(drafter.lm_head.weight, f.get_tensor("lm_head.weight"))
    assert not drafter.embed_tokens.weight.requires_grad and not drafter.lm_head.weight.requires_grad
    assert not any(k.startswith(("embed_tokens", "lm_head")) for k in drafter.trainable_state_dict())


def test_tied_embeddings_reuse_the_embedding(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=8, tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).save_pretrained(tmp_path)
    embed, head = load_embeddings(str(tmp_path), tie_word_embeddings=True)
    assert torch.equal(embed, head) and embed.shape == (50, 16)


def test_mask_rule_matches_the_design_by_brute_force():
    # Two samples: contexts of 5 and 3 positions; blocks anchored at (s0, 2), (s0, 5), (s1, 3); 2 slots each.
    ctx = [(0, p) for p in range(5)] + [(1, p) for p in range(3)]
    blocks = [(0, 2), (0, 5), (1, 3)]
    n_in = 2
    layout = BlockLayout(
        key_sample=torch.tensor([s for s, _ in ctx] + [blocks[b][0] for b in range(3) for _ in range(n_in)]),
        key_pos=torch.tensor([p for _, p in ctx] + [0] * 6),
        key_block=torch.tensor([-1] * len(ctx) + [b for b in range(3) for _ in range(n_in)]),
        query_sample=torch.tensor([blocks[b][0] for b in range(3) for _ in range(n_in)]),
        query_anchor=torch.tensor([blocks[b][1] for b in range(3) for _ in range(n_in)]),
        query_block=torch.tensor([b for b in range(3) for _ in range(n_in)]),
    )
    mask = dense_mask(layout)
    for qi in range(6):
        s, anchor = blocks[qi // n_in]
        for ki in range(len(ctx) + 6):
            if ki < len(ctx):
                expect = ctx[ki][0] == s and ctx[ki][1] < anchor
            else:
                expect = (ki - len(ctx)) // n_in == qi // n_in
            assert bool(mask[qi, ki]) == expect, (qi, ki)


def _pack_one(sample, anchors, config):
    return pack([sample], [torch.tensor(anchors)], config)


def test_block_sees_only_context_before_its_anchor_and_its_own_block(tiny_qwen3_target, samples):
    drafter = build(tiny_qwen3_target)
    sample = samples[0]
    first = int(torch.nonzero(sample.loss_mask)[0])
    anchors = [first + 2, first + 8]
    batch = _pack_one(sample, anchors, drafter.config)
    mask = dense_mask(batch.layout)
    args = (batch.block_input_ids, batch.block_position_ids, batch.context_hidden, batch.context_position_ids)
    with torch.no_grad():
        base = drafter(*args, mask)
        # Context at or after the first anchor: block 0 must not change, block 1 must.
        poked = batch.context_hidden.clone()
        poked[anchors[0]:] += 3.0
        out = drafter(args[0], args[1], poked, args[3], mask)
        assert torch.allclose(out[0], base[0], atol=1e-6)
        assert not torch.allclose(out[1], base[1], atol=1e-3)
        # Another block's input tokens are invisible.
        ids = batch.block_input_ids.clone()
        ids[1, 0] = (ids[1, 0] + 1) % drafter.config.vocab_size
        out = drafter(ids, args[1], args[2], args[3], mask)
        assert torch.allclose(out[0], base[0], atol=1e-6)


@pytest.mark.parametrize("markov", ["vanilla", "gated", "rnn"])
def test_draft_block_samples_from_the_training_distribution(tiny_qwen3_target, samples, markov):
    """The sampled block's probs equal the teacher-forced training logits for the tokens it drew."""
    drafter = build(tiny_qwen3_target, markov_head_type=markov)
    sample = samples[1]
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    gen = torch.Generator().manual_seed(7)
    block = drafter.draft_block(sample.hidden_states[:anchor], int(sample.input_ids[anchor]), anchor,
                                temperature=1.0, generator=gen)
    gamma = drafter.block_size
    assert block.tokens.shape == (gamma,) and block.probs.shape == (gamma, drafter.config.vocab_size)
    assert block.probs.dtype == torch.float32 and torch.allclose(block.probs.sum(-1), torch.ones(gamma))
    assert block.confidences is not None and ((block.confidences > 0) & (block.confidences < 1)).all()

    batch = _pack_one(sample, [anchor], drafter.config)
    with torch.no_grad():
        h = drafter(batch.block_input_ids, batch.block_position_ids, batch.context_hidden,
                    batch.context_position_ids, dense_mask(batch.layout))  # [1, γ, d]
        prev = torch.cat([torch.tensor([int(sample.input_ids[anchor])]), block.tokens[:-1]]).unsqueeze(0)
        logits = drafter.lm_head(h) + drafter.markov_head.bias(drafter.markov_head.features(prev, h))
        conf = torch.sigmoid(drafter.confidence_head(h, drafter.markov_head.embed_prev(prev)))
    assert torch.allclose(block.probs, torch.softmax(logits[0], -1), atol=1e-5)
    assert torch.allclose(block.confidences, conf[0], atol=1e-5)


def greedy(drafter, sample, anchor):
    ctx, token = sample.hidden_states[:anchor], int(sample.input_ids[anchor])
    return drafter.draft_block(ctx, token, anchor, 0.0)


def test_greedy_is_argmax(tiny_qwen3_target, samples):
    drafter = build(tiny_qwen3_target)
    sample = samples[2]
    start = int(torch.nonzero(sample.loss_mask)[0])
    for anchor in (start + 1, start + 4):
        block = greedy(drafter, sample, anchor)
        assert torch.equal(block.probs.argmax(-1), block.tokens)
        assert torch.equal(block.probs.sum(-1), torch.ones(drafter.block_size))


@pytest.mark.parametrize("markov", ["vanilla", "rnn"])
def test_batched_ragged_rows_grown_in_pieces_draft_as_each_row_alone(tiny_qwen3_target, samples, markov):
    """Rows of different context lengths, appended a few positions at a time (as decoding does),
    padded and masked into one backbone pass, give each row's own single-sequence block."""
    drafter = build(tiny_qwen3_target, markov_head_type=markov)
    starts = [int(torch.nonzero(s.loss_mask)[0]) for s in samples]
    anchors = [starts[0] + 2, starts[1] + 7, starts[2] + 4]
    context = drafter.new_context()
    for _ in samples:
        context.add_row()
    done = [0, 0, 0]
    while done != anchors:  # ragged growth: 3 positions per row per step, rows finish at different times
        step = [min(a, d + 3) for a, d in zip(anchors, done, strict=True)]
        drafter.extend_context(context, [s.hidden_states[d:e] if e > d else None
                                         for s, d, e in zip(samples, done, step, strict=True)])
        done = step
    assert context.lengths == anchors
    tokens = torch.tensor([int(s.input_ids[a]) for s, a in zip(samples, anchors, strict=True)])
    batch = drafter.draft(context, tokens, temperature=0.0)
    for r, (sample, anchor) in enumerate(zip(samples, anchors, strict=True)):
        alone = greedy(drafter, sample, anchor)
        assert torch.equal(batch.dist.tokens[r], alone.tokens)
        torch.testing.assert_close(batch.confidences[r], alone.confidences, atol=1e-5, rtol=1e-5)
    context.keep([2, 0])  # a request leaves; the others keep their rows
    again = drafter.draft(context, tokens[[2, 0]], temperature=0.0)
    assert torch.equal(again.dist.tokens, batch.dist.tokens[[2, 0]])


def test_top_k_draft_is_the_renormalised_distribution_on_base_and_markov_candidates(tiny_qwen3_target,
                                                                                   samples):
    """With top_k a slot's candidates are the k best base logits and the k tokens the vanilla
    bias favours after the previous token; the drafted tokens come from the softmax of base logits
    + Markov bias over those, and that (not the full softmax) is handed to verification."""
    drafter = build(tiny_qwen3_target)
    sample = samples[1]
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    ctx, token = sample.hidden_states[:anchor], int(sample.input_ids[anchor])
    block = drafter.draft_block(ctx, token, anchor, 1.0, torch.Generator().manual_seed(1), top_k=8)
    full = drafter.draft_block(ctx, token, anchor, 1.0, torch.Generator().manual_seed(1))
    assert torch.allclose(block.probs.sum(-1), torch.ones(4))
    assert all(block.probs[k, t] > 0 for k, t in enumerate(block.tokens.tolist()))
    batch = _pack_one(sample, [anchor], drafter.config)
    with torch.no_grad():
        h = drafter(batch.block_input_ids, batch.block_position_ids, batch.context_hidden,
                    batch.context_position_ids, dense_mask(batch.layout))
        prev = torch.cat([torch.tensor([token]), block.tokens[:-1]]).unsqueeze(0)
        base = drafter.lm_head(h)[0]
        bias = drafter.markov_head.bias(drafter.markov_head.features(prev, h))[0]
    candidates = torch.zeros_like(base, dtype=torch.bool)
    candidates.scatter_(-1, base.topk(8, dim=-1).indices, True)
    candidates.scatter_(-1, bias.topk(8, dim=-1).indices, True)  # the vanilla bias: prev alone
    assert ((candidates.sum(-1) > 8) & (candidates.sum(-1) <= 16)).all()  # the bias added its own
    expected = torch.softmax((base + bias).masked_fill(~candidates, float("-inf")), -1)
    torch.testing.assert_close(block.probs, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(block.probs, full.probs, atol=1e-3)  # truncation did change it


def test_favoured_tokens_are_kept_per_token_until_the_weights_change(tiny_qwen3_target):
    """favoured_after(x) is the top k of W2·W1[x], kept for the vocabulary and recomputed after
    an update of either table (a head trained further must not draft from stale candidates)."""
    head = build(tiny_qwen3_target).markov_head
    prev = torch.tensor([3, 5, 3])
    got = head.favoured_after(prev, 4)
    with torch.no_grad():
        direct = head.bias(head.embed_prev(prev)).topk(4, dim=-1).indices
    assert torch.equal(got, direct) and head._favoured.shape == (head.markov_w1.weight.shape[0], 4)
    with torch.no_grad():
        every = torch.arange(head.markov_w1.weight.shape[0])
        assert torch.equal(head._favoured_table(4, rows_per_block=7),  # blocks that do not divide V
                           head.bias(head.embed_prev(every)).topk(4, dim=-1).indices)
    with torch.no_grad():
        head.markov_w2.weight.mul_(-1.0)  # in place: same storage, new version
        flipped = head.bias(head.embed_prev(prev)).topk(4, dim=-1).indices
    assert not torch.equal(flipped, direct) and torch.equal(head.favoured_after(prev, 4), flipped)
    gated = build(tiny_qwen3_target, markov_head_type="gated").markov_head
    with pytest.raises(ValueError, match="vanilla"):
        gated.favoured_after(prev, 4)


def test_a_support_listing_a_token_twice_adds_up_in_the_dense_row():
    """The second copy of a repeated candidate carries probability 0; the dense distribution
    verification builds must keep the first copy's probability, not overwrite it with 0."""
    from dspark_cli.model.draw import DraftDist

    support = torch.tensor([[[4, 1, 4, 2]]])
    probs = torch.tensor([[[0.5, 0.3, 0.0, 0.2]]])
    dist = DraftDist(torch.tensor([[4]]), support, probs, torch.tensor([[0]]))
    row = dist.dense_row(torch.tensor([0]), torch.tensor([0]), 6)
    assert torch.equal(row, torch.tensor([[0.0, 0.3, 0.2, 0.0, 0.5, 0.0]]))


def test_fill_in_feeds_gamma_plus_one_slots(tiny_qwen3_target, samples):
    drafter = build(tiny_qwen3_target, block_convention="fill_in", markov_head_type="none",
                    enable_confidence_head=False)
    sample = samples[0]
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 2
    batch = _pack_one(sample, [anchor], drafter.config)
    assert batch.block_input_ids.shape == (1, drafter.block_size + 1)
    assert batch.block_position_ids[0].tolist() == list(range(anchor, anchor + drafter.block_size + 1))
    block = greedy(drafter, sample, anchor)
    assert block.tokens.shape == (drafter.block_size,) and block.confidences is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flex attention runs only under CUDA")
def test_flex_attention_matches_sdpa(tiny_qwen3_target, samples):  # pragma: no cover - CUDA only
    from dspark_cli.model.attention import flex_block_mask

    drafter = build(tiny_qwen3_target).cuda()
    sample = samples[0]
    first = int(torch.nonzero(sample.loss_mask)[0])
    batch = _pack_one(sample, [first + 1, first + 5, first + 9], drafter.config).to("cuda")
    args = (batch.block_input_ids, batch.block_position_ids, batch.context_hidden, batch.context_position_ids)
    with torch.no_grad():
        sdpa = drafter(*args, dense_mask(batch.layout))
        flex = drafter(*args, flex_block_mask(batch.layout))
    assert torch.allclose(sdpa, flex, atol=1e-4)


@pytest.mark.parametrize("markov", ["gated", "rnn"])
def test_markov_heads_follow_the_deepspec_equations(tiny_qwen3_target, markov):
    """Teacher-forced features and step-by-step sampling both equal the equations of DESIGN.md §3."""
    drafter = build(tiny_qwen3_target, markov_head_type=markov)
    head = drafter.markov_head
    for p in head.parameters():
        torch.nn.init.normal_(p, std=0.3, generator=torch.Generator().manual_seed(p.numel()))
    gen = torch.Generator().manual_seed(11)
    prev = torch.randint(0, drafter.config.vocab_size, (2, 4), generator=gen)
    hidden = torch.randn(2, 4, 32, generator=gen)
    e = head.markov_w1.weight[prev]
    if markov == "gated":
        W, b = head.gate_proj.weight, head.gate_proj.bias
        expected = torch.sigmoid(torch.cat([hidden, e], -1) @ W.T + b) * e
    else:
        W, b = head.joint_proj.weight, head.joint_proj.bias
        s, outs = torch.zeros(2, 16), []
        for k in range(4):
            g, c, o = (torch.cat([s, e[:, k], hidden[:, k]], -1) @ W.T + b).chunk(3, -1)
            outs.append(torch.tanh(o))
            s = torch.sigmoid(g) * s + (1 - torch.sigmoid(g)) * torch.tanh(c)
        expected = torch.stack(outs, 1)
    with torch.no_grad():
        assert torch.allclose(head.features(prev, hidden), expected, atol=1e-6)
        state, steps = None, []
        for k in range(4):
            z, state = head.step(prev[:, k], hidden[:, k], state)
            steps.append(z)
        assert torch.allclose(torch.stack(steps, 1), expected, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vocab_logits_are_the_linear_layer_s_for_every_row_count(dtype):
    """The few-row `W · xᵀ` form (float32 CPU) gives F.linear's logits; other cases are F.linear."""
    import torch.nn.functional as F

    from dspark_cli.model.vocab_logits import FEW_ROWS, vocab_logits

    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(1000, 64, generator=gen).to(dtype)
    for rows in (1, 2, 7, FEW_ROWS, FEW_ROWS + 1, 40):
        hidden = torch.randn(rows, 64, generator=gen).to(dtype)
        got, want = vocab_logits(hidden, weight), F.linear(hidden, weight)
        assert got.shape == want.shape == (rows, 1000) and got.dtype == want.dtype
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("draft_vocab", [None, 96])
def test_a_prepacked_drafter_drafts_from_a_packed_copy_of_its_draft_head(tiny_qwen3_target, samples,
                                                                       draft_vocab):
    """Eval prepacks the drafter (`prepack_linears`); its draft head (the whole lm_head, or the
    reduced vocabulary's rows) is then multiplied packed, with the plain drafter's numbers."""
    from dspark_cli.target.prepack import pack_weight, prepack_linears

    drafter = build(tiny_qwen3_target, **({"draft_vocab_size": draft_vocab} if draft_vocab else {}))
    if draft_vocab:
        drafter.draft_token_ids = torch.arange(0, 2 * draft_vocab, 2)  # a sorted subset of the rows
    sample = samples[1]
    anchor = int(torch.nonzero(sample.loss_mask)[0]) + 3
    context, token = sample.hidden_states[:anchor], int(sample.input_ids[anchor])

    def block():
        with torch.no_grad():
            return drafter.draft_block(context, token, anchor, 1.0, torch.Generator().manual_seed(3), top_k=8)

    plain = block()
    assert prepack_linears(drafter) > 0
    packed = block()
    assert torch.equal(packed.tokens, plain.tokens)
    torch.testing.assert_close(packed.probs, plain.probs, atol=1e-5, rtol=1e-5)
    hidden = torch.randn(5, drafter.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(drafter.draft_logits(hidden), hidden @ drafter.draft_head().t())
        zeros = pack_weight(torch.zeros_like(drafter.draft_head()))
        if draft_vocab:  # the packed copy is what the product reads
            key, weight, _ = drafter._draft_head
            drafter._draft_head = (key, weight, zeros)
        else:
            drafter.lm_head.packed_weight = zeros
        assert drafter.draft_logits(hidden).abs().max() == 0
    assert not torch.allclose(block().probs, plain.probs, atol=1e-3)  # and what draft() reads
    hidden.requires_grad_(True)  # a product that needs a gradient stays on the plain path
    drafter.draft_logits(hidden).sum().backward()
    assert hidden.grad is not None and hidden.grad.abs().max() > 0


def _ragged_context(drafter, samples):
    """Three requests of different context lengths (a mask in the backbone) and their anchors."""
    anchors = [int(torch.nonzero(s.loss_mask)[0]) + k for s, k in zip(samples, (2, 7, 4), strict=True)]
    context = drafter.new_context()
    for _ in samples:
        context.add_row()
    drafter.extend_context(context, [s.hidden_states[:a] for s, a in zip(samples, anchors, strict=True)])
    return context, torch.tensor([int(s.input_ids[a]) for s, a in zip(samples, anchors, strict=True)])


@pytest.mark.parametrize("markov", ["vanilla", "gated"])
def test_the_compiled_slot_loop_draws_what_the_eager_one_draws(tiny_qwen3_target, samples, markov):
    """target.compile_draft: the same seeded draws, tokens and candidates, the same distributions
    and confidences up to rounding, with candidates from the favoured table (vanilla) and a head
    with its own linear (gated); prepacked as eval loads the drafter."""
    from dspark_cli.target.prepack import prepack_linears

    drafter = build(tiny_qwen3_target, markov_head_type=markov)
    prepack_linears(drafter)
    context, anchors = _ragged_context(drafter, samples)
    runs = []
    for compiled in (False, True):
        drafter.compile_sampler(compiled)
        with torch.inference_mode():
            runs.append(drafter.draft(context, anchors, 1.0, torch.Generator().manual_seed(3), top_k=8))
        assert drafter._sampler.compiling == compiled  # the compiled function really ran
    eager, compiled = runs
    for name in ("tokens", "support", "index"):
        assert torch.equal(getattr(eager.dist, name), getattr(compiled.dist, name)), name
    torch.testing.assert_close(compiled.dist.probs, eager.dist.probs, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(compiled.confidences, eager.confidences, atol=1e-5, rtol=1e-4)


def test_a_sampler_that_fails_to_compile_drafts_eagerly_with_one_warning(tiny_qwen3_target, samples,
                                                                        monkeypatch, capsys):
    from dspark_cli import compiled

    def no_compiler(fn, **_):
        def call(*args, **kwargs):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")
        return call

    monkeypatch.setattr(compiled.torch, "compile", no_compiler)
    drafter = build(tiny_qwen3_target)
    context, anchors = _ragged_context(drafter, samples)
    with torch.inference_mode():
        eager = drafter.draft(context, anchors, 1.0, torch.Generator().manual_seed(3), top_k=8)
        drafter.compile_sampler(True)
        for _ in range(2):  # the second draft does not try again
            fallback = drafter.draft(context, anchors, 1.0, torch.Generator().manual_seed(3), top_k=8)
    assert not drafter._sampler.compiling
    assert torch.equal(fallback.dist.tokens, eager.dist.tokens)
    err = capsys.readouterr().err
    assert err.count("target.compile_draft: compiling the draft sampler failed") == 1
    assert "No working C++ compiler" in err and "more detail" not in err and "Traceback" not in err

