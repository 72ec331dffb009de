"""The DSpark loss (DESIGN.md §3), computed in chunks of blocks so memory stays bounded.

Per draft slot k (0-based) with weight w_k = exp(−k/γ_decay) over prefix-supervised slots:

    p_d = softmax(lm_head(h_k) + W2·z_k)            (Markov bias included)
    p_t = softmax(lm_head(final_hidden))            (frozen target head on the cached state)
    CE  = −log p_d[label]                           TV = ½‖p_d − p_t‖₁
    c*  = 1 − TV  (detached)                        BCE(σ(conf_logit), c*)
    loss = (ce_w·ΣwCE + tv_w·ΣwTV + conf_w·ΣwBCE) / Σw

The vocabulary-wide tensors ([blocks, γ, V]) exist for one chunk of `chunk_blocks` blocks at a
time: each chunk's loss is differentiated as soon as it is computed (w.r.t. the backbone states
and the head weights), its tensors are freed, and the backbone's backward runs once on the
accumulated state gradients. chunk_blocks = 0 computes everything at once.
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


def _chunk_terms(drafter: DSparkDrafter, hidden: torch.Tensor, target_hidden: torch.Tensor,
                 labels: torch.Tensor, prev: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Weighted sums for one chunk → [3 + 3γ]: ΣwCE, ΣwTV, ΣwBCE | per-slot Σc*, Σ∏c*, Σ|c−c*|.

    hidden/target_hidden [n, γ, d]; labels/prev [n, γ]; weight [n, γ] (0 on unsupervised slots).
    Only the first three entries carry gradients; the rest are statistics.
    """
    head = drafter.lm_head
    logits = head(hidden.to(head.weight.dtype)).float()  # [n, γ, V]
    prev_embed = None
    if drafter.markov_head is not None:
        z = drafter.markov_head.features(prev, hidden)  # [n, γ, r]
        logits = logits + drafter.markov_head.bias(z).float()
        prev_embed = drafter.markov_head.embed_prev(prev)
    logp_d = torch.log_softmax(logits, dim=-1)
    with torch.no_grad():
        p_t = torch.softmax(head(target_hidden.to(head.weight.dtype)).float(), dim=-1)  # [n, γ, V]
    ce = -logp_d.gather(-1, labels.unsqueeze(-1)).squeeze(-1)  # [n, γ]
    tv = 0.5 * (logp_d.exp() - p_t).abs().sum(-1)  # [n, γ]
    c_star = (1.0 - tv).detach().clamp(0.0, 1.0)
    supervised = (weight > 0).float()
    if drafter.confidence_head is not None:
        conf_logit = drafter.confidence_head(hidden, prev_embed).float()  # [n, γ]
        bce = F.binary_cross_entropy_with_logits(conf_logit, c_star, reduction="none")
        conf_err = (torch.sigmoid(conf_logit).detach() - c_star).abs() * supervised
    else:
        bce = torch.zeros_like(ce)
        conf_err = torch.zeros_like(ce)
    survive = torch.cumprod(c_star, dim=1)  # [n, γ] prefix acceptance ∏_{i≤k} c*_i
    sums = torch.stack([(weight * ce).sum(), (weight * tv).sum(), (weight * bce).sum()])
    stats = torch.cat([(c_star * supervised).sum(0), (survive * supervised).sum(0), conf_err.sum(0)])
    return torch.cat([sums, stats.detach()])


class _ChunkedObjective(torch.autograd.Function):
    """Σ_chunks coef·(ΣwCE, ΣwTV, ΣwBCE) with its gradients taken chunk by chunk in forward.

    Each chunk's vocabulary-wide tensors live only while its own gradient is computed; the
    gradients w.r.t. the backbone states [N, γ, d] and the head weights are kept (small) and
    scaled by the incoming gradient in backward. Unlike activation checkpointing, nothing is
    recomputed, so chunking costs no extra FLOPs.
    """

    @staticmethod
    def forward(ctx, hidden, target_hidden, labels, prev, weight, coef, chunk, drafter, *params):
        grad_hidden = torch.zeros_like(hidden)
        grad_params = [torch.zeros_like(p) for p in params]
        total = None
        for a in range(0, hidden.shape[0], chunk):
            with torch.enable_grad():
                h = hidden[a:a + chunk].detach().requires_grad_(True)
                part = _chunk_terms(drafter, h, target_hidden[a:a + chunk], labels[a:a + chunk],
                                    prev[a:a + chunk], weight[a:a + chunk])
                objective = coef[0] * part[0] + coef[1] * part[1] + coef[2] * part[2]
                grads = torch.autograd.grad(objective, [h, *params], allow_unused=True)
            grad_hidden[a:a + chunk] = grads[0]
            for acc, g in zip(grad_params, grads[1:], strict=True):
                if g is not None:
                    acc += g
            total = part.detach() if total is None else total + part.detach()
        ctx.save_for_backward(grad_hidden, *grad_params)
        ctx.mark_non_differentiable(total)
        return (coef[0] * total[0] + coef[1] * total[1] + coef[2] * total[2]), total

    @staticmethod
    def backward(ctx, grad_objective, _grad_total):
        grad_hidden, *grad_params = ctx.saved_tensors
        return (grad_hidden * grad_objective, None, None, None, None, None, None, None,
                *(g * grad_objective for g in grad_params))


class DrafterLoss(nn.Module):
    """Drafter + loss in one module, so DDP wraps a single forward(batch) → (loss, stats)."""

    def __init__(self, drafter: DSparkDrafter, weights: LossWeights, chunk_blocks: int = 64) -> None:
        super().__init__()
        self.drafter = drafter
        self.weights = weights
        self.chunk_blocks = chunk_blocks

    def forward(self, batch: PackedBatch, mask: object) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        d = self.drafter
        gamma = d.block_size
        hidden = d(batch.block_input_ids, batch.block_position_ids, batch.context_hidden,
                   batch.context_position_ids, mask)  # [N, γ, d]
        weight = slot_weights(gamma, self.weights.gamma_decay, hidden.device) * batch.valid.float()  # [N, γ]
        w = self.weights
        coef = (w.ce, w.tv, w.conf if d.confidence_head is not None else 0.0)
        N = hidden.shape[0]
        if self.chunk_blocks > 0 and torch.is_grad_enabled():
            heads = [m for m in (d.markov_head, d.confidence_head) if m is not None]
            params = [p for m in heads for p in m.parameters() if p.requires_grad]
            objective, total = _ChunkedObjective.apply(hidden, batch.target_hidden, batch.labels,
                                                       batch.prev_tokens, weight, coef, self.chunk_blocks, d,
                                                       *params)
        else:
            step = self.chunk_blocks if self.chunk_blocks > 0 else N
            total = sum(_chunk_terms(d, hidden[a:a + step], batch.target_hidden[a:a + step],
                                     batch.labels[a:a + step], batch.prev_tokens[a:a + step],
                                     weight[a:a + step]) for a in range(0, N, step))
            objective = coef[0] * total[0] + coef[1] * total[1] + coef[2] * total[2]
        w_sum = weight.sum().clamp_min(1e-8)
        loss = objective / w_sum
        ce, tv, bce = total[0] / w_sum, total[1] / w_sum, total[2] / w_sum
        supervised = batch.valid.float().sum(0)  # [γ]
        stats = {
            "loss": loss.detach(), "ce": ce.detach(), "tv": tv.detach(), "conf_bce": bce.detach(),
            "slot_accept_sum": total[3:3 + gamma].detach(),
            "slot_survive_sum": total[3 + gamma:3 + 2 * gamma].detach(),
            "conf_err_sum": total[3 + 2 * gamma:3 + 3 * gamma].detach(),
            "slot_count": supervised,
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
