"""The confidence head's bias, refitted on held-out blocks once training ends (docs/train.md).

The head learns c* = 1 − TV on the blocks it trains on, and over many epochs the drafter fits
those blocks far better than new ones: on the SmolLM2 demo at the bench-quality budget the
training set's slot-1 acceptance is 0.51 where the validation split's is 0.37, and the head says
0.50 on prompts it never saw, where 0.37 of them are accepted. That gap is an offset on the
logit scale, shared by every slot (logit c* moves by 0.3–0.6 at each of them), which STS cannot
fix (σ(logit / T) keeps 0.5 at 0.5) and which SGLang's STS file cannot carry. The head's bias is
shared by every slot and is read by every engine, so the offset goes there:

    δ = argmin_δ Σ w · BCE(σ(conf_logit + δ), c*)      over the validation split's slots

with the loss's own slot weights w; convex in δ, so a few Newton steps find it. The export then
carries `proj.bias + δ`; checkpoints keep the trained weights, so a resume refits the same δ.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..model.drafter import DSparkDrafter

#: Newton steps and the |step| below which the fit has converged.
MAX_STEPS, TOLERANCE = 50, 1e-7
#: A held-out shift larger than this is refused as a symptom (a broken split), not applied.
MAX_SHIFT = 5.0


@dataclass(frozen=True)
class ConfidenceShift:
    """δ and what it did on the held-out slots it was fitted on (means weighted as the fit)."""

    shift: float
    slots: int
    mean_target: float  # c*
    mean_confidence_before: float
    mean_confidence_after: float

    def to_dict(self) -> dict[str, float | int]:
        return asdict(self)


def flatten_slots(slots: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The (conf_logit, c*, weight) triples `DrafterLoss.forward` collects → three flat tensors."""
    return tuple(torch.cat([s[i].reshape(-1) for s in slots]) for i in range(3))  # type: ignore[return-value]


def fit_shift(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> float:
    """argmin_δ Σ w·BCE(σ(logits + δ), targets) by Newton's method (float64; flat tensors)."""
    z, t, w = (x.detach().double().reshape(-1) for x in (logits, targets, weights))
    if w.sum() <= 0:
        raise ValueError("no weighted slots to fit the confidence bias on")
    delta = 0.0
    for _ in range(MAX_STEPS):
        p = torch.sigmoid(z + delta)
        grad = float((w * (p - t)).sum())
        hess = float((w * p * (1 - p)).sum())
        if hess <= 0:
            break
        step = grad / hess
        delta -= step
        if abs(step) < TOLERANCE:
            break
    return float(delta)


def held_out_shift(drafter: DSparkDrafter, logits: torch.Tensor, targets: torch.Tensor,
                   weights: torch.Tensor) -> ConfidenceShift:
    """Fit δ on held-out (logit, c*, weight) slots and add it to the confidence head's bias."""
    delta = fit_shift(logits, targets, weights)
    if not abs(delta) <= MAX_SHIFT:
        raise ValueError(f"the held-out confidence shift {delta:+.2f} is beyond ±{MAX_SHIFT}")
    z, t, w = (x.detach().double().reshape(-1) for x in (logits, targets, weights))

    def mean(x: torch.Tensor) -> float:
        return float((w * x).sum() / w.sum())

    with torch.no_grad():
        drafter.confidence_head.proj.bias.add_(delta)
    return ConfidenceShift(delta, int((w > 0).sum()), mean(t), mean(torch.sigmoid(z)),
                           mean(torch.sigmoid(z + delta)))
