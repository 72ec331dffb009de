"""The inverse-CDF draw used by every sampler: it must follow the distribution it is given."""

from __future__ import annotations

import torch

from dspark_cli.model.draw import draw


def test_draw_follows_the_distribution_and_never_picks_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    for _ in range(4000):
        counts[int(draw(probs, gen))] += 1
    assert counts[[0, 2, 5]].sum() == 0
    assert (counts / counts.sum() - probs).abs().max() < 0.03


def test_draw_accepts_unnormalised_weights_and_is_seeded():
    weights = torch.tensor([2.0, 6.0])
    a = [int(draw(weights, torch.Generator().manual_seed(s))) for s in range(50)]
    b = [int(draw(weights, torch.Generator().manual_seed(s))) for s in range(50)]
    assert a == b and 25 < sum(a) < 50  # ~75% ones
