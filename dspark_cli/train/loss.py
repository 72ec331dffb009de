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
confidence head on c*) runs one ordinary backward. chunk_blocks = 0 computes everything at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..model.drafter import DSparkDrafter
from .blocks import PackedBatch


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
                 weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The vocabulary-wide part for some blocks → (ΣwCE, ΣwTV, c* [n, γ] detached).

    hidden/target_hidden [n, γ, d], z [n, γ, r] (Markov feature, None without a head),
    labels [n, γ], weight [n, γ] (0 on unsupervised slots).
    """
    logits = F.linear(hidden.to(lm_head.dtype), lm_head).float()  # [n, γ, V]
    if z is not None:
        logits = logits + F.linear(z, markov_w2).float()
    logp_d = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        p_t = torch.softmax(F.linear(target_hidden.to(lm_head.dtype), lm_head).float(), dim=-1)
    ce = -logp_d.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [n, γ]
    tv = 0.5 * (logp_d.exp() - p_t).abs().sum(-1)  # [n, γ]
    return (weight * ce).sum(), (weight * tv).sum(), (1.0 - tv).detach().clamp(0.0, 1.0)


class _ChunkedVocab(torch.autograd.Function):
    """ce_coef·ΣwCE + tv_coef·ΣwTV over all blocks, differentiated chunk by chunk in forward.

    Each chunk's [blocks, γ, V] tensors live only while its own gradient is taken (w.r.t. the
    backbone states, the Markov features z and W2); those gradients are small and are scaled
    by the incoming gradient in backward. Nothing is recomputed: chunking costs no extra FLOPs.
    Returns (objective, ΣwCE, ΣwTV, c* [N, γ]); only the objective is differentiable.
    """

    @staticmethod
    def forward(ctx, hidden, z, markov_w2, lm_head, target_hidden, labels, weight, ce_coef, tv_coef, chunk):
        grad_hidden = torch.zeros_like(hidden)
        grad_z = torch.zeros_like(z) if z is not None else None
        grad_w2 = torch.zeros_like(markov_w2) if z is not None else None
        ce_sum = tv_sum = hidden.new_zeros((), dtype=torch.float32)
        c_star = []
        for a in range(0, hidden.shape[0], chunk):
            sl = slice(a, a + chunk)
            with torch.enable_grad():
                h = hidden[sl].detach().requires_grad_(True)
                zc = z[sl].detach().requires_grad_(True) if z is not None else None
                ce, tv, cs = _vocab_terms(lm_head, markov_w2, h, zc, target_hidden[sl], labels[sl],
                                          weight[sl])
                inputs = [h] if z is None else [h, zc, markov_w2]
                grads = torch.autograd.grad(ce_coef * ce + tv_coef * tv, inputs, allow_unused=True)
            grad_hidden[sl] = grads[0] if grads[0] is not None else 0.0
            if z is not None:
                grad_z[sl] = grads[1] if grads[1] is not None else 0.0
                if grads[2] is not None:
                    grad_w2 += grads[2]
            ce_sum, tv_sum = ce_sum + ce.detach(), tv_sum + tv.detach()
            c_star.append(cs)
        ctx.has_z = z is not None
        ctx.save_for_backward(grad_hidden, *((grad_z, grad_w2) if z is not None else ()))
        c_star = torch.cat(c_star)
        ctx.mark_non_differentiable(ce_sum, tv_sum, c_star)
        return ce_coef * ce_sum + tv_coef * tv_sum, ce_sum, tv_sum, c_star

    @staticmethod
    def backward(ctx, grad_objective, *_unused):
        saved = ctx.saved_tensors
        grad_hidden = saved[0] * grad_objective
        grad_z = saved[1] * grad_objective if ctx.has_z else None
        grad_w2 = saved[2] * grad_objective if ctx.has_z else None
        return grad_hidden, grad_z, grad_w2, None, None, None, None, None, None, None


class DrafterLoss(nn.Module):
    """Drafter + loss in one module, so DDP wraps a single forward(batch) → (loss, stats)."""

    def __init__(self, drafter: DSparkDrafter, weights: LossWeights, chunk_blocks: int = 64) -> None:
        super().__init__()
        self.drafter = drafter
        self.weights = weights
        self.chunk_blocks = chunk_blocks

    def forward(self, batch: PackedBatch, mask: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        d, w = self.drafter, self.weights
        gamma = d.block_size
        hidden = d(batch.block_input_ids, batch.block_position_ids, batch.context_hidden,
                   batch.context_position_ids, mask)  # [N, γ, d]
        weight = slot_weights(gamma, w.gamma_decay, hidden.device) * batch.valid.float()  # [N, γ]
        prev = batch.prev_tokens
        z = d.markov_head.features(prev, hidden) if d.markov_head is not None else None  # [N, γ, r]
        w2 = d.markov_head.markov_w2.weight if d.markov_head is not None else None
        N = hidden.shape[0]
        step = self.chunk_blocks if self.chunk_blocks > 0 else N
        if self.chunk_blocks > 0 and torch.is_grad_enabled():
            vocab_objective, ce_sum, tv_sum, c_star = _ChunkedVocab.apply(
                hidden, z, w2, d.lm_head.weight, batch.target_hidden, batch.labels, weight, w.ce, w.tv, step)
        else:
            chunks = [slice(a, a + step) for a in range(0, N, step)]
            parts = [_vocab_terms(d.lm_head.weight, w2, hidden[sl], z[sl] if z is not None else None,
                                  batch.target_hidden[sl], batch.labels[sl], weight[sl]) for sl in chunks]
            ce_sum, tv_sum = sum(p[0] for p in parts), sum(p[1] for p in parts)
            c_star = torch.cat([p[2] for p in parts])
            vocab_objective = w.ce * ce_sum + w.tv * tv_sum
        supervised = batch.valid.float()  # [N, γ]
        if d.confidence_head is not None:
            prev_embed = d.markov_head.embed_prev(prev) if d.markov_head is not None else None
            conf_logit = d.confidence_head(hidden, prev_embed).float()  # [N, γ]
            bce = F.binary_cross_entropy_with_logits(conf_logit, c_star, reduction="none")  # [N, γ]
            bce_sum = (weight * bce).sum()
            conf_err = ((torch.sigmoid(conf_logit).detach() - c_star).abs() * supervised).sum(0)
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
