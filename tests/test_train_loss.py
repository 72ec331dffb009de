"""Anchors, blocks and the DSpark loss: exact conventions, a naive reference, chunking."""

from __future__ import annotations

import math

import pytest
import torch
from fixtures.drafter import drafter_config, make_samples

from dspark_cli.model.attention import dense_mask
from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.model.frozen import attach_frozen
from dspark_cli.sample import Sample
from dspark_cli.train.anchors import anchor_generator, candidate_anchors, sample_anchors
from dspark_cli.train.blocks import block_targets, pack
from dspark_cli.train.data import StepPlan
from dspark_cli.train.loss import DrafterLoss, LossWeights


def test_candidates_need_two_supervised_positions():
    mask = torch.tensor([0, 1, 1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    assert candidate_anchors(mask).tolist() == [1, 2, 5]


def test_anchor_sampling_is_seeded_sorted_and_bounded():
    mask = torch.ones(200, dtype=torch.bool)
    a = sample_anchors(mask, 16, anchor_generator(0, 0, 5))
    b = sample_anchors(mask, 16, anchor_generator(0, 0, 5))
    c = sample_anchors(mask, 16, anchor_generator(0, 1, 5))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert a.numel() == 16 and torch.equal(a, a.sort().values) and a.unique().numel() == 16
    assert sample_anchors(mask[:10], 512, anchor_generator(0, 0, 0)).tolist() == list(range(9))


def test_block_targets_anchor_first_with_prefix_mask():
    ids = torch.arange(100, 110)
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 1, 1], dtype=torch.bool)
    labels, prev, valid, state_pos = block_targets(ids, mask, torch.tensor([2, 7]), gamma=4)
    assert labels[0].tolist() == [103, 104, 105, 106]  # slot k predicts anchor + k + 1
    assert prev[0].tolist() == [102, 103, 104, 105]  # x_{k-1}; the anchor for slot 0
    assert valid[0].tolist() == [True, True, False, False]  # stops at position 5, stays stopped
    assert state_pos[0].tolist() == [2, 3, 4, 5]
    assert valid[1].tolist() == [True, True, False, False]  # runs off the sequence end at 10


def test_step_plan_same_micro_batches_for_any_world_size():
    single = StepPlan(40, 8, 2, world_size=1, rank=0, seed=3)
    ranks = [StepPlan(40, 8, 2, world_size=2, rank=r, seed=3) for r in range(2)]
    for step in range(7):
        epoch, micro = single.micro_batches(step)
        assert epoch == step // 5
        assert micro == ranks[0].micro_batches(step)[1] + ranks[1].micro_batches(step)[1]
    seen = [i for s in range(5) for mb in single.micro_batches(s)[1] for i in mb]
    assert sorted(seen) == list(range(40))  # one epoch covers every sample once


@pytest.fixture(scope="module")
def setup(tiny_qwen3_target):
    samples = make_samples(tiny_qwen3_target, n=2)
    torch.manual_seed(0)
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target))
    attach_frozen(drafter, str(tiny_qwen3_target))
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.3)
    anchors = [sample_anchors(s.loss_mask, 6, anchor_generator(0, 0, i)) for i, s in enumerate(samples)]
    return drafter, pack(samples, anchors, drafter.config)


def naive_loss(drafter, batch, w: LossWeights):
    """Slot by slot, straight from DESIGN.md §3."""
    h = drafter(batch.block_input_ids, batch.block_position_ids, batch.context_hidden,
                batch.context_position_ids, dense_mask(batch.layout))
    num = {"ce": 0.0, "tv": 0.0, "bce": 0.0}
    wsum = 0.0
    for n in range(h.shape[0]):
        for k in range(drafter.block_size):
            if not batch.valid[n, k]:
                continue
            wk = math.exp(-k / w.gamma_decay)
            prev = batch.prev_tokens[n, k]
            e = drafter.markov_head.markov_w1.weight[prev]
            logits = drafter.lm_head.weight @ h[n, k] + drafter.markov_head.markov_w2.weight @ e
            p_d = torch.softmax(logits, -1)
            p_t = torch.softmax(drafter.lm_head.weight @ batch.target_hidden[n, k].float(), -1)
            tv = 0.5 * (p_d - p_t).abs().sum()
            c_star = (1 - tv).detach()
            c = torch.sigmoid(drafter.confidence_head.proj.weight[0] @ torch.cat([h[n, k], e])
                              + drafter.confidence_head.proj.bias[0])
            bce = -(c_star * torch.log(c) + (1 - c_star) * torch.log(1 - c))
            num["ce"] = num["ce"] - wk * torch.log(p_d[batch.labels[n, k]])
            num["tv"] = num["tv"] + wk * tv
            num["bce"] = num["bce"] + wk * bce
            wsum += wk
    return (w.ce * num["ce"] + w.tv * num["tv"] + w.conf * num["bce"]) / wsum


def grads(drafter, loss):
    drafter.zero_grad()
    loss.backward()
    return {k: p.grad.clone() for k, p in drafter.named_parameters() if p.requires_grad}


def test_loss_matches_the_design_formula(setup):
    drafter, batch = setup
    weights = LossWeights(0.1, 0.9, 1.0, 4.0)
    loss, stats = DrafterLoss(drafter, weights, chunk_blocks=0)(batch, dense_mask(batch.layout))
    reference = naive_loss(drafter, batch, weights)
    assert torch.allclose(loss, reference, atol=1e-5)
    g_fast, g_ref = grads(drafter, loss), grads(drafter, reference)
    for k in g_fast:
        assert torch.allclose(g_fast[k], g_ref[k], atol=1e-5), k
    assert batch.valid.sum() > 0 and float(stats["slot_count"].sum()) == float(batch.valid.sum())


def test_chunked_loss_equals_unchunked_and_saves_no_full_vocab_tensor(setup):
    drafter, batch = setup
    weights = LossWeights()
    N, gamma, V = batch.num_blocks, drafter.block_size, drafter.config.vocab_size
    results = {}
    for chunk in (0, 2):
        biggest = []

        def pack_hook(t, biggest=biggest):
            if V in t.shape:  # vocabulary-wide tensors only
                biggest.append(t.numel())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack_hook, lambda t: t):
            loss, stats = DrafterLoss(drafter, weights, chunk_blocks=chunk)(batch, dense_mask(batch.layout))
        results[chunk] = (loss, stats, grads(drafter, loss), max(biggest, default=0))
    (l0, s0, g0, peak0), (l2, s2, g2, peak2) = results[0], results[2]
    assert torch.allclose(l0, l2, atol=1e-6)
    for k in g0:
        assert torch.allclose(g0[k], g2[k], atol=1e-6), k
    for k in s0:
        assert torch.allclose(s0[k], s2[k], atol=1e-5), k
    assert peak0 >= N * gamma * V  # unchunked keeps the [N, γ, V] softmax for backward
    assert peak2 <= max(V * drafter.config.hidden_size, 2 * gamma * V) < N * gamma * V


@pytest.mark.parametrize("head,weights", [("none", LossWeights(1.0, 0.0, 0.0)),
                                          ("gated", LossWeights(0.1, 0.9, 1.0)),
                                          ("rnn", LossWeights(0.5, 0.5, 0.0))])
def test_hand_written_chunk_gradient_equals_autograd(tiny_qwen3_target, setup, head, weights):
    """The chunked path's gradient is derived by hand; autograd through the formula must agree."""
    _, batch = setup
    torch.manual_seed(1)
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target, markov_head_type=head,
                                           enable_confidence_head=head != "none"))
    attach_frozen(drafter, str(tiny_qwen3_target))
    if drafter.markov_head is not None:
        torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.3)
    mask = dense_mask(batch.layout)
    ref, ref_stats = DrafterLoss(drafter, weights, chunk_blocks=0)(batch, mask)
    g_ref = grads(drafter, ref)
    fast, fast_stats = DrafterLoss(drafter, weights, chunk_blocks=3)(batch, mask)
    g_fast = grads(drafter, fast)
    assert torch.allclose(fast, ref, atol=1e-6)
    assert torch.allclose(fast_stats["slot_accept_sum"], ref_stats["slot_accept_sum"], atol=1e-5)
    assert any(g.abs().sum() > 0 for g in g_ref.values())
    for k in g_ref:
        assert torch.allclose(g_fast[k], g_ref[k], atol=1e-6, rtol=1e-4), k


def test_bf16_chunk_gradient_is_close_to_autograd(setup):
    """Under bf16 autocast both paths round the vocabulary matmuls alike: gradients stay close."""
    drafter, batch = setup
    mask = dense_mask(batch.layout)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, _ = DrafterLoss(drafter, LossWeights(), chunk_blocks=0)(batch, mask)
    g_ref = grads(drafter, ref)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fast, _ = DrafterLoss(drafter, LossWeights(), chunk_blocks=4)(batch, mask)
    g_fast = grads(drafter, fast)
    assert abs(fast.item() - ref.item()) < 1e-2 * abs(ref.item())
    for k in g_ref:
        scale = float(g_ref[k].norm())
        assert float((g_fast[k] - g_ref[k]).norm()) <= 0.05 * scale + 1e-6, k


def test_detached_confidence_inputs_leave_the_drafting_gradients_to_ce_and_tv(setup):
    """train.detach_confidence_inputs: the BCE trains the confidence head and nothing else."""
    drafter, batch = setup
    mask = dense_mask(batch.layout)
    joint = grads(drafter, DrafterLoss(drafter, LossWeights(), chunk_blocks=3)(batch, mask)[0])
    detached = grads(drafter, DrafterLoss(drafter, LossWeights(), chunk_blocks=3,
                                          detach_confidence_inputs=True)(batch, mask)[0])
    no_bce = grads(drafter, DrafterLoss(drafter, LossWeights(conf=0.0), chunk_blocks=3)(batch, mask)[0])
    head = [k for k in joint if k.startswith("confidence_head.")]
    drafting = [k for k in joint if k not in head]
    assert head and drafting
    for k in head:  # the head's own gradient does not depend on where its inputs came from
        assert torch.allclose(detached[k], joint[k], atol=1e-6), k
    for k in drafting:
        assert torch.allclose(detached[k], no_bce[k], atol=1e-6), k
    assert any(not torch.allclose(joint[k], no_bce[k], atol=1e-6) for k in drafting)


def test_dflash_baseline_is_weighted_ce_only(tiny_qwen3_target, setup):
    _, batch = setup
    torch.manual_seed(0)
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target, markov_head_type="none",
                                           enable_confidence_head=False))
    attach_frozen(drafter, str(tiny_qwen3_target))
    loss_fn = DrafterLoss(drafter, LossWeights(1.0, 0.0, 0.0), chunk_blocks=3)
    loss, stats = loss_fn(batch, dense_mask(batch.layout))
    assert torch.allclose(loss, stats["ce"]) and float(stats["conf_bce"]) == 0.0
    assert all(p.grad is None for p in drafter.parameters())
    loss.backward()
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.abs().sum() > 0


def test_bf16_autocast_is_close_to_fp32(setup):
    drafter, batch = setup
    module = DrafterLoss(drafter, LossWeights(), chunk_blocks=4)
    with torch.no_grad():
        full, _ = module(batch, dense_mask(batch.layout))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            half, _ = module(batch, dense_mask(batch.layout))
    assert half.dtype == torch.float32 and torch.isfinite(half)
    assert abs(float(half) - float(full)) < 0.05 * abs(float(full))


def test_fill_in_trains_on_the_slots_after_the_anchor(tiny_qwen3_target, setup):
    _, anchor_first_batch = setup
    torch.manual_seed(0)
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target, block_convention="fill_in",
                                           markov_head_type="none", enable_confidence_head=False))
    attach_frozen(drafter, str(tiny_qwen3_target))
    samples = make_samples(tiny_qwen3_target, n=1)
    anchors = [sample_anchors(samples[0].loss_mask, 5, anchor_generator(0, 0, 0))]
    batch = pack(samples, anchors, drafter.config)
    gamma = drafter.block_size
    assert batch.block_input_ids.shape[1] == gamma + 1
    assert (batch.block_input_ids[:, 1:] == drafter.config.mask_token_id).all()
    assert torch.equal(batch.labels, block_targets(samples[0].input_ids, samples[0].loss_mask,
                                                   anchors[0], gamma)[0])
    loss, stats = DrafterLoss(drafter, LossWeights(1.0, 0.0, 0.0))(batch, dense_mask(batch.layout))
    # Reference: slots 1..γ of the full block output, CE against anchor + k.
    hidden = drafter.backbone(batch.block_input_ids.reshape(1, -1), batch.block_position_ids.reshape(1, -1),
                              drafter.context_kv(drafter.fuse_context(batch.context_hidden).unsqueeze(0),
                                                 batch.context_position_ids.unsqueeze(0)),
                              dense_mask(batch.layout)).view(batch.num_blocks, gamma + 1, -1)[:, 1:]
    ce = torch.nn.functional.cross_entropy(drafter.lm_head(hidden).flatten(0, 1), batch.labels.flatten(),
                                           reduction="none").view(-1, gamma)
    w = torch.exp(-torch.arange(gamma) / 4.0) * batch.valid
    assert torch.allclose(loss, (w * ce).sum() / w.sum(), atol=1e-5)


def test_compact_final_hidden_packs_what_a_dense_layout_would(tiny_qwen3_target, setup):
    """The samples carry final_hidden only at the loss-mask positions; the packed targets (and so
    the loss) are bit for bit what gathering from a zero-filled [T, d] copy gives, zeros included."""
    drafter, _ = setup
    s = make_samples(tiny_qwen3_target, n=1)[0]
    first = int(s.final_positions[0])
    holed = s.loss_mask.clone()
    holed[first + 5:first + 8] = False  # a second prompt turn inside the sequence
    s = Sample(s.sample_id, s.input_ids, holed, s.hidden_states, s.final_hidden[holed[s.loss_mask]])
    assert s.final_hidden.shape == (int(holed.sum()), 32)
    dense = torch.zeros(len(s.input_ids), 32, dtype=torch.bfloat16)
    dense[s.final_positions] = s.final_hidden
    anchors = sample_anchors(holed, 12, anchor_generator(0, 0, 0))
    state_pos = block_targets(s.input_ids, holed, anchors, drafter.block_size)[3]
    batch = pack([s], [anchors], drafter.config)
    assert torch.equal(batch.target_hidden, dense[state_pos])
    off = ~holed[state_pos]
    assert off.any() and (~off).any()  # both kinds of slot occur
    assert (batch.target_hidden[off] == 0).all()
