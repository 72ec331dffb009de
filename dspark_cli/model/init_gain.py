"""The final-norm gain a fresh drafter starts with (docs/train.md, "Initialisation").

A fresh drafter's residual stream is the frozen embedding of its input token, and the frozen
`lm_head` reads it back through the final norm. With tied embeddings a token's own row scores it
far above the rest: on SmolLM2-135M the mask token's normed embedding gives logits of std 15.7 and
its own logit ~79, so the first step's cross-entropy is ~48 nats where uniform is 10.8 and the
target's own distributions have a logit std of ~3.4. "auto" scales the final norm's gain so the
mask slots' initial logits spread like the target's (never above 1, the previous release's gain):

    gain = min(1, std_v(lm_head(final_hidden)) / std_v(lm_head(norm(embed[mask]))))

A tiny random target whose logits are already flatter than its own embedding read-back keeps 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..sample import Sample
from .drafter import DSparkDrafter

#: Samples whose target states set the reference spread (their final_hidden rows, every one).
REFERENCE_SAMPLES = 8


@dataclass(frozen=True)
class OutputGain:
    gain: float
    target_logit_std: float | None  # None when the gain was given, not matched
    init_logit_std: float | None

    def to_dict(self) -> dict[str, float | None]:
        return {"gain": self.gain, "target_logit_std": self.target_logit_std,
                "init_logit_std": self.init_logit_std}


def logit_std(lm_head: torch.Tensor, hidden: torch.Tensor) -> float:
    """Mean over rows of the vocabulary-wide std of lm_head(hidden) (fp32, chunks of 256 rows)."""
    head = lm_head.float()
    stds = [(rows.float() @ head.T).std(-1) for rows in hidden.reshape(-1, hidden.shape[-1]).split(256)]
    return float(torch.cat(stds).mean())


def reference_states(samples: Sequence[Sample], limit: int = REFERENCE_SAMPLES) -> torch.Tensor | None:
    """The target's final states of the first `limit` samples that have them → [N, d], or None."""
    rows = [s.final_hidden for s in (samples[i] for i in range(min(limit, len(samples))))
            if s.final_hidden is not None and len(s.final_hidden)]
    return torch.cat(rows) if rows else None


@torch.no_grad()
def matched_gain(drafter: DSparkDrafter, target_final: torch.Tensor) -> OutputGain:
    """The gain at which the mask slot's initial logits have the target's logit spread (≤ 1)."""
    head = drafter.lm_head.weight
    mask_row = drafter.embed_tokens.weight[drafter.config.mask_token_id].float().unsqueeze(0)
    at_unit_gain = F.rms_norm(mask_row, mask_row.shape[-1:], eps=drafter.config.rms_norm_eps)
    init_std = logit_std(head, at_unit_gain)
    target_std = logit_std(head, target_final)
    gain = min(1.0, target_std / init_std) if init_std > 0 else 1.0
    return OutputGain(gain, target_std, init_std)


@torch.no_grad()
def set_output_gain(drafter: DSparkDrafter, setting: float | str,
                    samples: Sequence[Sample]) -> OutputGain:
    """Apply `train.init_output_gain` ("auto" or a number) to a fresh drafter's final norm."""
    if setting == "auto":
        states = reference_states(samples)
        chosen = matched_gain(drafter, states) if states is not None else OutputGain(1.0, None, None)
    else:
        chosen = OutputGain(float(setting), None, None)
    drafter.norm.weight.fill_(chosen.gain)
    return chosen


def describe_gain(chosen: OutputGain | None) -> str:
    """One phrase for the train log: the gain and, when matched, the two spreads behind it."""
    if chosen is None:
        return "unknown"
    if chosen.target_logit_std is None:
        return f"{chosen.gain:.3g}"
    return (f"{chosen.gain:.3g} (auto: target logit std {chosen.target_logit_std:.2f}, mask slot at "
            f"gain 1 {chosen.init_logit_std:.2f})")
