"""The confidence head's held-out bias: the fit finds a known offset, and the head gets it."""

from __future__ import annotations

import pytest
import torch
from fixtures.drafter import drafter_config

from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.train.confidence_bias import MAX_SHIFT, fit_shift, held_out_shift


def test_fit_shift_recovers_the_offset_of_soft_targets():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2000, generator=g) * 1.5
    weights = torch.rand(2000, generator=g)
    targets = torch.sigmoid(logits - 0.45)  # the head is 0.45 too confident on the logit scale
    assert fit_shift(logits, targets, weights) == pytest.approx(-0.45, abs=1e-6)


def test_fit_shift_on_hard_labels_matches_their_weighted_rate():
    logits = torch.zeros(10)
    targets = torch.tensor([1.0, 0, 0, 0, 1, 0, 0, 0, 0, 0])
    weights = torch.ones(10)
    # A constant head: σ(δ) must equal the label mean, 0.2.
    assert torch.sigmoid(torch.tensor(fit_shift(logits, targets, weights))) == pytest.approx(0.2, abs=1e-6)
    with pytest.raises(ValueError, match="no weighted slots"):
        fit_shift(logits, targets, torch.zeros(10))


def test_held_out_shift_moves_the_head_bias_and_reports_the_effect(tiny_qwen3_target):
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target))
    before = drafter.confidence_head.proj.bias.detach().clone()
    logits = torch.linspace(-2, 2, 50)
    shift = held_out_shift(drafter, logits, torch.sigmoid(logits + 0.8), torch.ones(50))
    assert shift.shift == pytest.approx(0.8, abs=1e-6) and shift.slots == 50
    assert shift.mean_confidence_after == pytest.approx(shift.mean_target, abs=1e-6)
    assert shift.mean_confidence_before < shift.mean_target
    assert torch.allclose(drafter.confidence_head.proj.bias, before + shift.shift)


def test_a_shift_beyond_the_bound_is_refused_and_leaves_the_head_alone(tiny_qwen3_target):
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target))
    before = drafter.confidence_head.proj.bias.detach().clone()
    logits = torch.zeros(20)
    with pytest.raises(ValueError, match="beyond"):
        held_out_shift(drafter, logits, torch.full((20,), 1e-4), torch.ones(20))  # logit −9.2
    assert torch.equal(drafter.confidence_head.proj.bias, before)
    assert MAX_SHIFT < 9
