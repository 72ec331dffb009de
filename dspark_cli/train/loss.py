"""The DSpark loss (DESIGN.md §3), computed in chunks of blocks so memory stays bounded.

Per draft slot k (0-based) with weight w_k = exp(−k/γ_decay) over prefix-supervised slots:

    p_d = softmax(lm_head(h_k) + W2·z_k)            (Markov bias included)
    p_t = softmax(lm_head(final_hidden))            (frozen target head on the cached state)
    CE  = −log p_d[label]                           TV = ½‖p_d − p_t‖₁
    c*  = 1 − TV  (detached)                        BCE(σ(conf_logit), c*)
    loss = (ce_w·ΣwCE + tv_w·ΣwTV + conf_w·ΣwBCE) / Σw

The vocabulary-wide tensors ([blocks, γ, V]) exist for one chunk of `chunk_blocks` blocks at a
time: each chunk's CE/TV is differentiated as soon as it is computed (w.r.t. the backbone states,
the Markov features and W2), its tensors are freed, and the rest of the graph (backbone, W1,
confidence head on c*) runs one ordinary backward. The chunk's gradient is written out by hand
(`_fused_vocab_terms`: a few in-place passes, no autograd temporaries); chunk_blocks = 0 keeps
everything in one autograd graph through `_vocab_terms`, the reference the tests compare with.
With train.fast_kernels (the default) the chunks go through `vocab_fast.fast_vocab_terms` instead:
the same terms with target rows and vanilla Markov biases once per distinct state/token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from ..model.drafter import DSparkDrafter
from .blocks import PackedBatch
from .vocab_fast import Packed, VocabWorkspace, fast_vocab_terms
from .vocab_kernel import VocabKernel

DRAFT_VOCAB_NEEDS_FAST_KERNELS = ("model.draft_vocab_size needs train.fast_kernels = true (the earlier loss "
                                  "path computes the full vocabulary only).")


@dataclass
class LossWeights:
    ce: float = 0.1
    tv: float = 0.9
    conf: float = 1.0
    gamma_decay: float = 4.0


def slot_weights(gamma: int, gamma_decay: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """w_k = exp(−k/γ_decay), k = 0..γ−1 → [γ]."""
    return torch.exp(-torch.arange(gamma, device=device, dtype=torch.float32) / gamma_decay)


def _vocab_terms(lm_head: torch.Tensor, markov_w2: torch.Tensor | None, hidden: torch.Tensor,
                 z: torch.Tensor | None, target_hidden: torch.Tensor, labels: torch.Tensor,
                 weight: torch.Tensor, draft_ids: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The vocabulary-wide part for some blocks → (ΣwCE, ΣwTV, c* [n, γ] detached).

    hidden/target_hidden [n, γ, d], z [n, γ, r] (Markov feature, None without a head),
    labels [n, γ], weight [n, γ] (0 on unsupervised slots). With a reduced draft vocabulary
    (draft_ids [N], target ids) p_d lives on those N tokens and is zero elsewhere: labels are draft
    ids (-1: outside it, no CE) and TV counts the target's mass outside as a difference too.
    """
    draft_head = lm_head if draft_ids is None else lm_head[draft_ids]
    logits = F.linear(hidden.to(lm_head.dtype), draft_head).float()  # [n, γ, N]
    if z is not None:
        logits = logits + F.linear(z, markov_w2).float()
    logp_d = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        p_t = torch.softmax(F.linear(target_hidden.to(lm_head.dtype), lm_head).float(), dim=-1)
        outside = 0.0
        if draft_ids is not None:
            p_t = p_t[..., draft_ids]
            outside = (1.0 - p_t.sum(-1)).clamp_min(0.0)
    in_vocab = labels >= 0
    ce = -logp_d.gather(-1, labels.clamp_min(0).unsqueeze(-1)).squeeze(-1) * in_vocab  # [n, γ]
    tv = 0.5 * ((logp_d.exp() - p_t).abs().sum(-1) + outside)  # [n, γ]
    return (weight * ce).sum(), (weight * tv).sum(), (1.0 - tv).detach().clamp(0.0, 1.0)


def _fused_vocab_terms(lm_head: torch.Tensor, markov_w2: torch.Tensor | None, hidden: torch.Tensor,
                      z: torch.Tensor | None, target_hidden: torch.Tensor, labels: torch.Tensor,
                      weight: torch.Tensor, ce_coef: float, tv_coef: float, need_grad: bool,
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
    """`_vocab_terms` plus its gradient, written out by hand so the [n, γ, V] work is a few
    in-place passes over two buffers instead of autograd's dozen fresh tensors.

    On CPU every fresh vocabulary-wide tensor costs as much as the pass that fills it (page
    faults); at SmolLM2 sizes a DSpark step got 1.3× and a DFlash step 2× faster. The maths is the
    same (tests compare it with autograd through `_vocab_terms`). With L the logits,
    p = softmax(L), q = p_t, s = sign(p − q), m = Σ s·p, row weight w:

        ∂CE/∂L = p − e_y        ∂TV/∂L = ½ p (s − m)
        G = w·[(ce − ½tv·m)·p + ½tv·s·p] − w·ce·e_y

    lm_head/markov_w2 are already in the matmul dtype. Returns (ΣwCE, ΣwTV, c* [n, γ], grads) with
    grads = (∂/∂hidden, ∂/∂z, ∂/∂W2) of ce_coef·ΣwCE + tv_coef·ΣwTV, or None when not need_grad.
    """
    n, gamma, _ = hidden.shape
    cdt = lm_head.dtype
    labels = labels.reshape(-1, 1)
    w = weight.reshape(-1, 1).float()
    h = hidden.reshape(n * gamma, -1).to(cdt)
    logits = F.linear(h, lm_head).float()  # [R, V], the only draft-side vocabulary buffer
    if z is not None:
        zf = z.reshape(n * gamma, -1).to(cdt)
        logits += F.linear(zf, markov_w2)
    picked = logits.gather(-1, labels)
    top = logits.amax(-1, keepdim=True)
    p = logits.sub_(top).exp_()
    total = p.sum(-1, keepdim=True)
    p.div_(total)
    ce = (top + total.log() - picked).squeeze(-1)  # −log p[y]
    with torch.no_grad():
        q = F.linear(target_hidden.reshape(n * gamma, -1).to(cdt), lm_head).float()
        q.sub_(q.amax(-1, keepdim=True)).exp_()
        q.div_(q.sum(-1, keepdim=True))
    diff = torch.sub(p, q, out=q)  # p − q, reusing the target buffer
    tv = 0.5 * torch.linalg.vector_norm(diff, ord=1, dim=-1)
    wf = w.squeeze(-1)
    ce_sum, tv_sum = (wf * ce).sum(), (wf * tv).sum()
    c_star = (1.0 - tv).clamp(0.0, 1.0).view(n, gamma)
    if not need_grad:
        return ce_sum, tv_sum, c_star, None
    if tv_coef != 0.0:
        sp = diff.sign_().mul_(p)  # s·p, in the target buffer
        m = sp.sum(-1, keepdim=True)
        # G = w·[(ce − ½tv·m)·p + ½tv·s·p]: two in-place passes over the s·p buffer
        grad = sp.mul_(0.5 * tv_coef * w).addcmul_(p, (ce_coef - 0.5 * tv_coef * m) * w)
    else:
        grad = p.mul_(ce_coef * w)
    grad.scatter_add_(-1, labels, -ce_coef * w)
    grad = grad.to(cdt)
    grad_hidden = (grad @ lm_head).view(n, gamma, -1).to(hidden.dtype)
    if z is None:
        return ce_sum, tv_sum, c_star, (grad_hidden, None, None)
    grad_z = (grad @ markov_w2).view(n, gamma, -1).to(z.dtype)
    grad_w2 = grad.t() @ zf  # in the matmul dtype; the caller casts it to the parameter's
    return ce_sum, tv_sum, c_star, (grad_hidden, grad_z, grad_w2)


def compute_dtype(device_type: str) -> torch.dtype | None:
    """The autocast dtype for tensors on `device_type`, None outside an autocast region."""
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else None


def _vocab_chunks(lm_head: torch.Tensor, w2_compute: torch.Tensor | None, hidden: torch.Tensor,
                  z: torch.Tensor | None, target_hidden: torch.Tensor, labels: torch.Tensor,
                  weight: torch.Tensor, ce_coef: float, tv_coef: float, chunk: int, need_grad: bool,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
    """`_fused_vocab_terms` over blocks `chunk` at a time → (ΣwCE, ΣwTV, c* [N, γ], grads).

    grads = (∂/∂hidden [N, γ, d], ∂/∂z, ∂/∂W2 summed over chunks in float32), None when not
    need_grad; only one chunk's vocabulary-wide buffers exist at a time.
    """
    grad_hidden = torch.empty_like(hidden) if need_grad else None
    grad_z = torch.empty_like(z) if need_grad and z is not None else None
    grad_w2 = None
    ce_sum = tv_sum = hidden.new_zeros((), dtype=torch.float32)
    c_star = []
    for a in range(0, hidden.shape[0], chunk):
        sl = slice(a, a + chunk)
        ce, tv, cs, grads = _fused_vocab_terms(
            lm_head, w2_compute, hidden[sl].detach(), z[sl].detach() if z is not None else None,
            target_hidden[sl], labels[sl], weight[sl], ce_coef, tv_coef, need_grad)
        if need_grad:
            grad_hidden[sl] = grads[0]
            if z is not None:
                grad_z[sl] = grads[1]
                g = grads[2].float()
                grad_w2 = g if grad_w2 is None else grad_w2.add_(g)
        ce_sum, tv_sum = ce_sum + ce, tv_sum + tv
        c_star.append(cs)
    grads = (grad_hidden, grad_z, grad_w2) if need_grad else None
    return ce_sum, tv_sum, torch.cat(c_star), grads


class _ChunkedVocab(torch.autograd.Function):
    """ce_coef·ΣwCE + tv_coef·ΣwTV over all blocks, differentiated chunk by chunk in forward.

    Each chunk's [blocks, γ, V] tensors live only while its own gradient is taken (w.r.t. the
    backbone states, the Markov features z and W2, by `_fused_vocab_terms`); those gradients are
    small and are scaled by the incoming gradient in backward. Nothing is recomputed: chunking
    costs no extra FLOPs. Returns (objective, ΣwCE, ΣwTV, c* [N, γ]); only the objective is
    differentiable. `lm_head` and `w2_compute` are the weights in the matmul dtype.
    """

    @staticmethod
    def forward(ctx, hidden, z, markov_w2, lm_head, w2_compute, target_hidden, labels, weight, ce_coef,
                tv_coef, chunk):
        ce_sum, tv_sum, c_star, (grad_hidden, grad_z, grad_w2) = _vocab_chunks(
            lm_head, w2_compute, hidden, z, target_hidden, labels, weight, ce_coef, tv_coef, chunk,
            need_grad=True)
        ctx.has_z = z is not None
        if ctx.has_z:
            grad_w2 = grad_w2.to(markov_w2.dtype)
        ctx.save_for_backward(grad_hidden, *((grad_z, grad_w2) if ctx.has_z else ()))
        ctx.mark_non_differentiable(ce_sum, tv_sum, c_star)
        return ce_coef * ce_sum + tv_coef * tv_sum, ce_sum, tv_sum, c_star

    @staticmethod
    def backward(ctx, grad_objective, *_unused):
        saved = ctx.saved_tensors
        grad_hidden = saved[0] * grad_objective
        grad_z = saved[1] * grad_objective if ctx.has_z else None
        grad_w2 = saved[2] * grad_objective if ctx.has_z else None
        return grad_hidden, grad_z, grad_w2, None, None, None, None, None, None, None, None


def _fast_chunks(ws: VocabWorkspace, head: Packed, w2_packed: Packed | None, hidden: torch.Tensor,
                 z: torch.Tensor | None, z_index: torch.Tensor | None, target_hidden: torch.Tensor,
                 labels: torch.Tensor, weight: torch.Tensor, ce_coef: float, tv_coef: float, chunk: int,
                 need_grad: bool, reduced: tuple[Packed, torch.Tensor] | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
    """`_vocab_chunks` through `vocab_fast` (train.fast_kernels). z is per row [N, γ, r], or for
    the vanilla head the batch's distinct features [U, r] with z_index [N, γ] naming each row's.
    `reduced`: (the target's whole packed head, the draft vocabulary's target ids) when `head`
    holds a reduced draft vocabulary's rows (labels then draft ids, -1 outside)."""
    target, draft_ids = reduced if reduced is not None else (None, None)
    grad_hidden = torch.empty_like(hidden) if need_grad else None
    grad_z = grad_w2 = None
    if need_grad and z is not None:
        grad_z = torch.zeros_like(z) if z_index is not None else torch.empty_like(z)
        grad_w2 = torch.zeros(w2_packed.rows.shape, dtype=torch.float32, device=hidden.device)
    ce_sum = tv_sum = hidden.new_zeros((), dtype=torch.float32)
    c_star = []
    for a in range(0, hidden.shape[0], chunk):
        sl = slice(a, a + chunk)
        zc, zi, tokens = (z[sl].detach() if z is not None else None), None, None
        if z_index is not None:  # the chunk's own distinct tokens, so its buffers stay chunk-sized
            tokens, zi = torch.unique(z_index[sl].reshape(-1), return_inverse=True)
            zc = z.detach()[tokens]
        ce, tv, cs, grads = fast_vocab_terms(ws, head, w2_packed, hidden[sl].detach(), zc, zi,
                                             target_hidden[sl], labels[sl], weight[sl], ce_coef, tv_coef,
                                             need_grad, grad_w2, target, draft_ids)
        if need_grad:
            grad_hidden[sl] = grads[0]
            if z is not None:
                if tokens is not None:
                    grad_z.index_add_(0, tokens, grads[1])
                else:
                    grad_z[sl] = grads[1]
        ce_sum, tv_sum = ce_sum + ce, tv_sum + tv
        c_star.append(cs)
    grads = (grad_hidden, grad_z, grad_w2) if need_grad else None
    return ce_sum, tv_sum, torch.cat(c_star), grads


class _FastVocab(torch.autograd.Function):
    """`_ChunkedVocab` through `_fast_chunks`: the same objective and outputs, fewer FLOPs."""

    @staticmethod
    def forward(ctx, hidden, z, markov_w2, ws, head, w2_packed, z_index, target_hidden, labels, weight,
                ce_coef, tv_coef, chunk, reduced):
        ce_sum, tv_sum, c_star, (grad_hidden, grad_z, grad_w2) = _fast_chunks(
            ws, head, w2_packed, hidden, z, z_index, target_hidden, labels, weight, ce_coef, tv_coef, chunk,
            need_grad=True, reduced=reduced)
        ctx.has_z = z is not None
        if ctx.has_z:
            grad_w2 = grad_w2.to(markov_w2.dtype)
        ctx.save_for_backward(grad_hidden, *((grad_z, grad_w2) if ctx.has_z else ()))
        ctx.mark_non_differentiable(ce_sum, tv_sum, c_star)
        return ce_coef * ce_sum + tv_coef * tv_sum, ce_sum, tv_sum, c_star

    @staticmethod
    def backward(ctx, grad_objective, *_unused):
        # Scaled in place: the saved gradients are this graph's own and backward runs once (the
        # trainer never retains the graph), and a fresh [V, r] product per micro-batch costs page
        # faults as large as the multiplication.
        saved = ctx.saved_tensors
        grad_hidden = saved[0].mul_(grad_objective)
        grad_z = saved[1].mul_(grad_objective) if ctx.has_z else None
        grad_w2 = saved[2].mul_(grad_objective) if ctx.has_z else None
        return (grad_hidden, grad_z, grad_w2, *(None,) * 11)


class DrafterLoss(nn.Module):
    """Drafter + loss in one module, so DDP wraps a single forward(batch) → (loss, stats)."""

    def __init__(self, drafter: DSparkDrafter, weights: LossWeights, chunk_blocks: int = 64,
                 detach_confidence_inputs: bool = False, fast_kernels: bool = True,
                 compile_vocab: bool = False) -> None:
        super().__init__()
        self.drafter = drafter
        self.weights = weights
        self.chunk_blocks = chunk_blocks
        #: The vocabulary-wide terms through `vocab_fast` (train.fast_kernels); False: the fused path.
        self.fast_kernels = fast_kernels
        #: compile_vocab: the fast path's elementwise passes as one compiled kernel (vocab_kernel.py).
        self.workspace = VocabWorkspace(VocabKernel() if compile_vocab and fast_kernels else None)
        #: The BCE reaches only the confidence head's own weights (train.detach_confidence_inputs).
        self.detach_confidence_inputs = detach_confidence_inputs
        self._head_cache: tuple[tuple, torch.Tensor] | None = None
        self._draft_of: tuple[tuple, torch.Tensor] | None = None
        if drafter.draft_token_ids is not None and not fast_kernels:
            raise ConfigError(DRAFT_VOCAB_NEEDS_FAST_KERNELS)

    def draft_labels(self, labels: torch.Tensor) -> torch.Tensor:
        """Target-id labels → draft ids of a reduced draft vocabulary, -1 for tokens outside it."""
        ids = self.drafter.draft_token_ids
        if ids is None:
            return labels
        key = (ids.data_ptr(), ids._version, ids.device)
        if self._draft_of is None or self._draft_of[0] != key:
            table = torch.full((self.drafter.config.vocab_size,), -1, dtype=torch.long, device=ids.device)
            table[ids] = torch.arange(ids.shape[0], device=ids.device)
            self._draft_of = (key, table)
        return self._draft_of[1][labels]

    def head_for_matmul(self, dtype: torch.dtype | None) -> torch.Tensor:
        """The frozen lm_head in the matmul dtype, cast once: autocast would recast the
        [V, d] weight on every call because it does not require grad."""
        weight = self.drafter.lm_head.weight
        dtype = dtype or weight.dtype
        key = (weight.data_ptr(), weight._version, weight.device, dtype)
        if self._head_cache is None or self._head_cache[0] != key:
            self._head_cache = (key, weight.detach().to(dtype))
        return self._head_cache[1]

    def forward(self, batch: PackedBatch, mask: object, confidence_out: list | None = None
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """`confidence_out`, when given, receives (conf_logit, c*, slot weight) [N, γ] detached:
        the held-out pass refits the confidence head's bias on them (`confidence_bias`)."""
        d, w = self.drafter, self.weights
        gamma = d.block_size
        hidden = d(batch.block_input_ids, batch.block_position_ids, batch.context_hidden,
                   batch.context_position_ids, mask)  # [N, γ, d]
        weight = slot_weights(gamma, w.gamma_decay, hidden.device) * batch.valid.float()  # [N, γ]
        prev = batch.prev_tokens
        w2 = d.markov_head.markov_w2.weight if d.markov_head is not None else None
        N = hidden.shape[0]
        step = self.chunk_blocks if self.chunk_blocks > 0 else N
        reference = self.chunk_blocks == 0 and torch.is_grad_enabled()
        z_index = None
        fast = self.fast_kernels and not reference
        if d.markov_head is not None and d.markov_head.kind == "vanilla" and fast:
            tokens, z_index = torch.unique(prev, return_inverse=True)  # z = W1[x]: once per token
            z = d.markov_head.embed_prev(tokens)  # [U, r]
        else:
            z = d.markov_head.features(prev, hidden) if d.markov_head is not None else None  # [N, γ, r]
        labels = self.draft_labels(batch.labels)
        if fast:
            dtype = compute_dtype(hidden.device.type) or d.lm_head.weight.dtype
            head = self.workspace.head(d.draft_head(), dtype)
            reduced = None
            if d.draft_token_ids is not None:
                reduced = (self.workspace.head(d.lm_head.weight, dtype, name="target"), d.draft_token_ids)
            w2_packed = self.workspace.markov(w2, head.dtype) if w2 is not None else None
            rest = (z_index, batch.target_hidden, labels, weight, w.ce, w.tv, step)
            if torch.is_grad_enabled():
                vocab_objective, ce_sum, tv_sum, c_star = _FastVocab.apply(
                    hidden, z, w2, self.workspace, head, w2_packed, *rest, reduced)
            else:
                ce_sum, tv_sum, c_star, _ = _fast_chunks(self.workspace, head, w2_packed, hidden, z, *rest,
                                                         need_grad=False, reduced=reduced)
                vocab_objective = w.ce * ce_sum + w.tv * tv_sum
        elif reference:  # the autograd reference
            ce_sum, tv_sum, c_star = _vocab_terms(d.lm_head.weight, w2, hidden, z, batch.target_hidden,
                                                  labels, weight, d.draft_token_ids)
            vocab_objective = w.ce * ce_sum + w.tv * tv_sum
        else:
            head = self.head_for_matmul(compute_dtype(hidden.device.type))
            w2_compute = w2.detach().to(head.dtype) if w2 is not None else None
            rest = (batch.target_hidden, batch.labels, weight, w.ce, w.tv, step)
            if torch.is_grad_enabled():
                vocab_objective, ce_sum, tv_sum, c_star = _ChunkedVocab.apply(
                    hidden, z, w2, head, w2_compute, *rest)
            else:
                ce_sum, tv_sum, c_star, _ = _vocab_chunks(head, w2_compute, hidden, z, *rest, need_grad=False)
                vocab_objective = w.ce * ce_sum + w.tv * tv_sum
        supervised = batch.valid.float()  # [N, γ]
        if d.confidence_head is not None:
            prev_embed = None
            if z_index is not None:  # W1[x] of the distinct tokens, gathered: one [V, r] backward, not two
                prev_embed = z[z_index]
            elif d.markov_head is not None:
                prev_embed = d.markov_head.embed_prev(prev)
            conf_hidden = hidden
            if self.detach_confidence_inputs:
                conf_hidden = hidden.detach()
                prev_embed = prev_embed.detach() if prev_embed is not None else None
            conf_logit = d.confidence_head(conf_hidden, prev_embed).float()  # [N, γ]
            bce = F.binary_cross_entropy_with_logits(conf_logit, c_star, reduction="none")  # [N, γ]
            bce_sum = (weight * bce).sum()
            conf_err = ((torch.sigmoid(conf_logit).detach() - c_star).abs() * supervised).sum(0)
            if confidence_out is not None:
                confidence_out.append((conf_logit.detach(), c_star.detach(), weight.detach()))
            objective = vocab_objective + w.conf * bce_sum
        else:
            bce_sum = torch.zeros((), device=hidden.device)
            conf_err = torch.zeros(gamma, device=hidden.device)
            objective = vocab_objective
        w_sum = weight.sum().clamp_min(1e-8)
        loss = objective / w_sum
        stats = {
            "loss": loss.detach(), "ce": (ce_sum / w_sum).detach(), "tv": (tv_sum / w_sum).detach(),
            "conf_bce": (bce_sum / w_sum).detach(),
            "slot_accept_sum": (c_star * supervised).sum(0),
            "slot_survive_sum": (torch.cumprod(c_star, dim=1) * supervised).sum(0),  # ∏_{i≤k} c*_i
            "conf_err_sum": conf_err,
            "slot_count": supervised.sum(0),
            "blocks": torch.tensor(float(N)),
        }
        return loss, stats


def summarize(stats: dict[str, torch.Tensor], has_confidence: bool) -> dict[str, float | list[float]]:
    """Per-slot acceptance, expected accepted length 1 + Σ_k mean(∏_{i≤k} c*_i), confidence error."""
    count = stats["slot_count"].clamp_min(1.0)
    accept = (stats["slot_accept_sum"] / count).tolist()
    survive = stats["slot_survive_sum"] / count
    out: dict[str, float | list[float]] = {
        "loss": float(stats["loss"]), "ce": float(stats["ce"]), "tv": float(stats["tv"]),
        "slot_acceptance": [round(a, 5) for a in accept],
        "accepted_length": 1.0 + float(survive.sum()),
    }
    if has_confidence:
        out["conf_bce"] = float(stats["conf_bce"])
        out["conf_error"] = float(stats["conf_err_sum"].sum() / stats["slot_count"].sum().clamp_min(1.0))
    return {k: (v if isinstance(v, list) or math.isfinite(v) else float("nan")) for k, v in out.items()}
