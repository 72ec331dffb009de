"""train.fast_kernels: the vocabulary-wide loss through `vocab_fast` gives the loss, statistics and
gradients of the earlier path (fast_kernels = false), for every head kind, in fp32 and bf16, with
its elementwise passes eager or compiled by TorchInductor (train.compile_vocab)."""

from __future__ import annotations

import pytest
import torch
from fixtures.drafter import drafter_config, make_samples

from dspark_cli.model.attention import SplitMask, dense_mask, split_mask
from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.model.frozen import attach_frozen
from dspark_cli.train.anchors import anchor_generator, sample_anchors
from dspark_cli.train.blocks import pack
from dspark_cli.train.loss import DrafterLoss, LossWeights

HEADS = [  # (markov head, confidence head, loss weights)
    ("vanilla", True, LossWeights()),
    ("vanilla", False, LossWeights(0.3, 0.7, 0.0)),
    ("gated", True, LossWeights()),
    ("gated", False, LossWeights()),
    ("rnn", True, LossWeights()),
    ("rnn", False, LossWeights(0.5, 0.5, 0.0)),
    ("none", False, LossWeights(1.0, 0.0, 0.0)),  # DFlash: CE only
]


@pytest.fixture(scope="module")
def batch(tiny_qwen3_target):
    samples = make_samples(tiny_qwen3_target, n=2)
    config = drafter_config(tiny_qwen3_target)
    # Many anchors per sample: blocks overlap, so states and previous tokens repeat across rows
    # (the case the fast path deduplicates), and chunks of 3 blocks split repeats across chunks.
    anchors = [sample_anchors(s.loss_mask, 12, anchor_generator(0, 0, i)) for i, s in enumerate(samples)]
    return pack(samples, anchors, config)


def run(drafter, batch, weights, fast: bool, bf16: bool, chunk: int = 3, compiled: bool = False):
    drafter.zero_grad(set_to_none=True)
    module = DrafterLoss(drafter, weights, chunk_blocks=chunk, fast_kernels=fast, compile_vocab=compiled)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    with ctx:
        loss, stats = module(batch, dense_mask(batch.layout))
    loss.backward()
    grads = {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}
    assert not compiled or not module.workspace.kernel.failed  # the compiled kernel really ran
    return loss.detach(), stats, grads


#: The compiled kernel on one case per graph it compiles: a per-token bias, a per-row one folded into
#: the logits (each with CE + TV), and CE alone without a Markov head. Each compile costs seconds.
CASES = [(*h, False) for h in HEADS] + [(*HEADS[i], True) for i in (0, 2, 6)]


@pytest.mark.parametrize("head,confidence,weights,compiled", CASES,
                         ids=[f"{h}-{'conf' if c else 'noconf'}{'-compiled' if k else ''}"
                              for h, c, _, k in CASES])
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_fast_kernels_match_the_earlier_path(tiny_qwen3_target, batch, head, confidence, weights, compiled,
                                             bf16):
    torch.manual_seed(1)
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target, markov_head_type=head,
                                           enable_confidence_head=confidence))
    attach_frozen(drafter, str(tiny_qwen3_target))
    if drafter.markov_head is not None:
        torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.3)
    # the case this path exists for: rows that share a target state or a previous token
    states = batch.target_hidden.reshape(-1, batch.target_hidden.shape[-1])
    assert torch.unique(states, dim=0).shape[0] < states.shape[0]
    ref_loss, ref_stats, ref_grads = run(drafter, batch, weights, fast=False, bf16=bf16)
    loss, stats, grads = run(drafter, batch, weights, fast=True, bf16=bf16, compiled=compiled)
    tol = 2e-2 if bf16 else 1e-5  # bf16: sums rounded in another order
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss))
    for k in ("ce", "tv", "conf_bce", "slot_accept_sum", "slot_survive_sum", "slot_count"):
        assert torch.allclose(stats[k], ref_stats[k], rtol=tol, atol=tol), k
    assert grads.keys() == ref_grads.keys() and grads
    assert any(float(g.abs().sum()) > 0 for g in ref_grads.values())
    for k, ref in ref_grads.items():
        scale = float(ref.norm())
        assert float((grads[k] - ref).norm()) <= (5e-2 if bf16 else 1e-4) * scale + 1e-7, k


def test_fast_kernels_unchunked_and_without_grad(tiny_qwen3_target, batch):
    """chunk 0 under no_grad (the held-out pass) and one chunk of every block give the same figures."""
    torch.manual_seed(1)
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target))
    attach_frozen(drafter, str(tiny_qwen3_target))
    torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.3)
    mask = dense_mask(batch.layout)
    with torch.no_grad():
        ref, ref_stats = DrafterLoss(drafter, LossWeights(), chunk_blocks=0, fast_kernels=False)(batch, mask)
        fast, stats = DrafterLoss(drafter, LossWeights(), chunk_blocks=0)(batch, mask)
    assert torch.allclose(fast, ref, atol=1e-5)
    assert torch.allclose(stats["slot_accept_sum"], ref_stats["slot_accept_sum"], atol=1e-4)
    one, _, g_one = run(drafter, batch, LossWeights(), fast=True, bf16=False, chunk=batch.num_blocks)
    three, _, g_three = run(drafter, batch, LossWeights(), fast=True, bf16=False, chunk=3)
    assert torch.allclose(one, three, atol=1e-6)
    for k in g_one:
        assert torch.allclose(g_one[k], g_three[k], atol=1e-6, rtol=1e-4), k


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_split_attention_equals_the_dense_mask(tiny_qwen3_target, batch, bf16):
    """Attention over each block's own slots and its visible context gives the states (and the
    gradients) of SDPA under the dense [Q, C + Q] mask."""
    torch.manual_seed(2)
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target))  # GQA: 4 query heads on 2 kv heads
    assert drafter.config.num_attention_heads > drafter.config.num_key_value_heads
    split = split_mask(batch.layout)
    assert isinstance(split, SplitMask) and split.block == drafter.config.block_inputs
    out = {}
    for name, mask in (("dense", dense_mask(batch.layout)), ("split", split)):
        drafter.zero_grad(set_to_none=True)
        ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
        with ctx:
            h = drafter(batch.block_input_ids, batch.block_position_ids, batch.context_hidden,
                        batch.context_position_ids, mask)
        (h.float() * torch.linspace(-1, 1, h.shape[-1])).sum().backward()
        out[name] = (h.detach().float(), {k: p.grad.clone() for k, p in drafter.named_parameters()
                                          if p.grad is not None})
    (h_dense, g_dense), (h_split, g_split) = out["dense"], out["split"]
    tol = 3e-2 if bf16 else 1e-5
    assert torch.allclose(h_split, h_dense, atol=tol, rtol=tol)
    assert g_split.keys() == g_dense.keys()
    for k in g_dense:
        assert float((g_split[k] - g_dense[k]).norm()) <= tol * float(g_dense[k].norm()) + 1e-6, k


def test_a_layout_that_is_not_block_by_block_keeps_the_dense_mask(batch):
    layout = batch.layout
    shuffled = type(layout)(**{**layout.__dict__, "query_block": layout.query_block.flip(0)})
    assert isinstance(split_mask(shuffled), torch.Tensor)


def test_a_kernel_that_fails_to_compile_falls_back_to_the_eager_passes(tiny_qwen3_target, batch,
                                                                       monkeypatch, capsys):
    """A machine without a working C++ compiler (the one thing not made to fail here for real:
    Inductor's on-disk cache may already hold the kernel) trains on, with one warning."""
    from dspark_cli.train import vocab_kernel

    def no_compiler(fn, **_):
        def call(*args, **kwargs):
            raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found\nmore detail")
        return call

    monkeypatch.setattr(vocab_kernel.torch, "compile", no_compiler)
    torch.manual_seed(1)
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target))
    attach_frozen(drafter, str(tiny_qwen3_target))
    eager_loss, _, eager_grads = run(drafter, batch, LossWeights(), fast=True, bf16=False)
    drafter.zero_grad(set_to_none=True)
    module = DrafterLoss(drafter, LossWeights(), chunk_blocks=3, compile_vocab=True)
    for _ in range(2):  # the second pass does not try again
        loss, _ = module(batch, dense_mask(batch.layout))
    assert module.workspace.kernel.failed
    assert torch.equal(loss.detach(), eager_loss)
    err = capsys.readouterr().err
    assert err.count("compiling the loss kernel failed") == 1 and "No working C++ compiler" in err
    assert "more detail" not in err and "Traceback" not in err


def test_compile_vocab_setting(monkeypatch):
    from dspark_cli.train import vocab_kernel

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(vocab_kernel, "compiler_found", lambda: True)
    assert vocab_kernel.wanted("auto", cpu, True) and not vocab_kernel.wanted("auto", cuda, True)
    assert not vocab_kernel.wanted("auto", cpu, False)  # fp32 steps: the matmuls dominate
    assert vocab_kernel.wanted(True, cuda, False) and not vocab_kernel.wanted(False, cpu, True)
    monkeypatch.setattr(vocab_kernel, "compiler_found", lambda: False)
    assert not vocab_kernel.wanted("auto", cpu, True)


def reduced_drafter(target, head: str, confidence: bool, batch) -> DSparkDrafter:
    """A drafter whose draft vocabulary holds half the labels of `batch` and random other tokens."""
    torch.manual_seed(2)
    labels = torch.unique(batch.labels[batch.valid.bool()])
    vocab = load_config_vocab(target)
    kept = labels[::2]  # every other label: the rest fall outside (no CE, their mass counts in TV)
    others = torch.randperm(vocab)[:64]
    ids = torch.unique(torch.cat([kept, others[~torch.isin(others, labels)]]))
    drafter = DSparkDrafter(drafter_config(target, markov_head_type=head, enable_confidence_head=confidence,
                                           draft_vocab_size=int(ids.shape[0])))
    attach_frozen(drafter, str(target))
    drafter.draft_token_ids.copy_(ids)
    if drafter.markov_head is not None:
        torch.nn.init.normal_(drafter.markov_head.markov_w2.weight, std=0.3)
    return drafter


def load_config_vocab(target) -> int:
    from dspark_cli.target.files import load_config
    return load_config(str(target)).vocab_size


@pytest.mark.parametrize("head,confidence,weights", [HEADS[0], HEADS[1], HEADS[2]],
                         ids=["vanilla", "vanilla-noconf", "gated"])  # the heads a reduced vocabulary takes
@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_reduced_draft_vocabulary_matches_the_autograd_reference(tiny_qwen3_target, batch, head, confidence,
                                                                   weights, bf16):
    """The fast path over N draft rows (chunks of 3 blocks, hand-written gradient) gives the loss,
    statistics and gradients of autograd through `_vocab_terms` with the same draft vocabulary."""
    drafter = reduced_drafter(tiny_qwen3_target, head, confidence, batch)
    ref_loss, ref_stats, ref_grads = run(drafter, batch, weights, fast=True, bf16=bf16, chunk=0)
    loss, stats, grads = run(drafter, batch, weights, fast=True, bf16=bf16, chunk=3)
    tol = 2e-2 if bf16 else 1e-5
    assert abs(float(loss) - float(ref_loss)) <= tol * abs(float(ref_loss))
    for k in ("ce", "tv", "conf_bce", "slot_accept_sum", "slot_survive_sum"):
        assert torch.allclose(stats[k], ref_stats[k], rtol=tol, atol=tol), k
    assert grads.keys() == ref_grads.keys() and grads
    if drafter.markov_head is not None:
        assert grads["markov_head.markov_w2.weight"].shape[0] == drafter.config.draft_vocab_size
    for k, ref in ref_grads.items():
        assert float((grads[k] - ref).norm()) <= (5e-2 if bf16 else 1e-4) * float(ref.norm()) + 1e-7, k


def test_a_reduced_vocabulary_scores_the_draft_as_zero_outside_it(tiny_qwen3_target, batch):
    """TV and CE of the reduced loss are those of the full-vocabulary distribution that is zero
    outside the draft vocabulary: computed here by hand over all V tokens."""
    drafter = reduced_drafter(tiny_qwen3_target, "vanilla", False, batch)
    ids = drafter.draft_token_ids
    with torch.no_grad():
        hidden = drafter(batch.block_input_ids, batch.block_position_ids, batch.context_hidden,
                         batch.context_position_ids, dense_mask(batch.layout))
        z = drafter.markov_head.features(batch.prev_tokens, hidden)
        logits = hidden @ drafter.lm_head.weight[ids].T + drafter.markov_head.bias(z)
        p_d = torch.zeros(*logits.shape[:2], drafter.config.vocab_size)
        p_d[..., ids] = torch.softmax(logits, -1)
        p_t = torch.softmax(batch.target_hidden.float() @ drafter.lm_head.weight.T, -1)
        tv = 0.5 * (p_d - p_t).abs().sum(-1)
        ce = -torch.log(p_d.gather(-1, batch.labels[..., None]).squeeze(-1))
        w = batch.valid.float() * torch.exp(-torch.arange(4.0) / LossWeights().gamma_decay)
        inside = torch.isin(batch.labels, ids)
        assert (~inside & batch.valid.bool()).any() and (inside & batch.valid.bool()).any()
        _, stats = DrafterLoss(drafter, LossWeights(), chunk_blocks=3)(batch, dense_mask(batch.layout))
    assert torch.allclose(stats["tv"], (w * tv).sum() / w.sum(), atol=1e-5)
    assert torch.allclose(stats["ce"], (w * torch.where(inside, ce, 0.0)).sum() / w.sum(), atol=1e-4)


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_a_reduced_vocabulary_takes_known_target_normalisers_from_the_table(tiny_qwen3_target, batch, bf16):
    """After one step every state's log-normaliser is in the workspace's table: the next step gives
    the same loss, statistics and gradients without the target head's other rows (corrupted here,
    they would change TV), and a changed head empties the table."""
    drafter = reduced_drafter(tiny_qwen3_target, "vanilla", True, batch)
    weights = LossWeights()
    module = DrafterLoss(drafter, weights, chunk_blocks=3, fast_kernels=True)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)

    def step():
        drafter.zero_grad(set_to_none=True)
        with ctx:
            loss, stats = module(batch, dense_mask(batch.layout))
        loss.backward()
        grads = {k: p.grad.clone() for k, p in drafter.named_parameters() if p.grad is not None}
        return float(loss.detach()), stats, grads

    loss, stats, grads = step()
    distinct = torch.unique(batch.target_hidden.reshape(-1, batch.target_hidden.shape[-1]), dim=0).shape[0]
    assert len(module.workspace.norms) == distinct
    target = next(p for key, (_, p) in module.workspace._heads.items() if key == "target")
    outside = torch.ones(target.vocab, dtype=torch.bool)
    outside[drafter.draft_token_ids] = False
    copies = [target.cols.t()]  # the packed copies only (fp32 rows are the weight itself)
    if target.rows.data_ptr() != drafter.lm_head.weight.data_ptr():
        copies.append(target.rows)
    with torch.no_grad():
        for packed in copies:
            packed[outside] += 3.0  # every normaliser computed from here on would be wrong
    again, stats_again, grads_again = step()
    tol = 1e-2 if bf16 else 1e-5
    assert abs(again - loss) <= tol * abs(loss)
    for k in ("ce", "tv", "conf_bce", "slot_accept_sum", "slot_survive_sum"):
        assert torch.allclose(stats_again[k], stats[k], rtol=tol, atol=tol), k
    for k, ref in grads.items():
        assert float((grads_again[k] - ref).norm()) <= (5e-2 if bf16 else 1e-4) * float(ref.norm()) + 1e-7, k
    with torch.no_grad():  # a new version of the head: the table is emptied and filled anew
        drafter.lm_head.weight[outside] += 3.0
    shifted, stats_shifted, _ = step()
    assert len(module.workspace.norms) == distinct
    assert float(stats_shifted["tv"]) > float(stats["tv"]) + 0.05  # the shifted head's mass outside


def test_teacher_norms_match_states_by_their_exact_bits():
    from dspark_cli.train.teacher_norms import TeacherNorms

    norms = TeacherNorms(max_entries=3).for_head("head")
    states = torch.randn(4, 8).to(torch.bfloat16)
    keys, checks = norms.keys(states)
    norms.store(keys, checks, torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert len(norms) == 3  # full: the fourth is not kept
    lse, known = norms.lookup(*norms.keys(states))
    assert known.tolist() == [True, True, True, False] and lse[:3].tolist() == [1.0, 2.0, 3.0]
    flipped = states.clone()
    flipped.view(torch.int16)[0, 0] ^= 1  # one bit
    assert norms.lookup(*norms.keys(flipped))[1].tolist() == [False, True, True, False]
    assert not norms.lookup(keys[:1], [checks[0] + 1])[1].item()  # same hash, another check: a collision
    assert len(norms.for_head("head")) == 3 and len(norms.for_head("another head")) == 0
