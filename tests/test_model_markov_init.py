"""Where a fresh Markov head's W1 starts (train.markov_init): the target's embedding geometry."""

from __future__ import annotations

import pytest
import torch
from fixtures.drafter import drafter_config

from dspark_cli.config import load_config
from dspark_cli.errors import ConfigError
from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.model.frozen import attach_frozen
from dspark_cli.model.markov_init import ROW_STD, embedding_rows, init_markov_rows


def test_tokens_embedded_alike_start_alike_and_the_main_direction_comes_first():
    torch.manual_seed(0)
    embed = torch.randn(200, 16) * torch.linspace(3.0, 0.1, 16)  # column 0 carries most variance
    embed[7] = embed[3]  # two tokens the target cannot tell apart
    rows = embedding_rows(embed, rank=8)
    assert rows.shape == (200, 8)
    assert rows.std().item() == pytest.approx(ROW_STD, rel=1e-3)  # the random init's spread
    assert torch.equal(rows[7], rows[3])
    variances = rows.var(0)
    assert bool((variances[:-1] >= variances[1:] - 1e-9).all())  # principal directions, largest first
    # Projections of the centred table: inner products follow the embedding's (rank ≥ d loses none).
    full = embedding_rows(embed, rank=16)
    centred = embed - embed.mean(0)
    scale = (full @ full.T)[0, 1] / (centred @ centred.T)[0, 1]
    assert torch.allclose(full @ full.T, scale * (centred @ centred.T), rtol=1e-3, atol=1e-6)


def test_a_rank_above_the_hidden_size_fills_the_extra_columns_with_noise_not_zeros():
    rows = embedding_rows(torch.randn(50, 4), rank=10)
    assert rows.shape == (50, 10)
    extra = rows[:, 4:]
    assert bool((extra.abs().sum(0) > 0).all())  # a zero column would leave its W2 column dead
    assert extra.std().item() == pytest.approx(ROW_STD, rel=0.3)


def test_the_setting_rewrites_only_w1_and_random_keeps_the_earlier_start(tiny_qwen3_target):
    torch.manual_seed(0)
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target))
    attach_frozen(drafter, str(tiny_qwen3_target))
    head = drafter.markov_head
    before = {k: v.clone() for k, v in head.state_dict().items()}
    init_markov_rows(head, drafter.embed_tokens.weight, "random")
    assert all(torch.equal(before[k], v) for k, v in head.state_dict().items())
    init_markov_rows(head, drafter.embed_tokens.weight, "embedding")
    expected = embedding_rows(drafter.embed_tokens.weight, head.rank)
    assert torch.allclose(head.markov_w1.weight, expected.to(head.markov_w1.weight.dtype))
    assert torch.equal(head.markov_w2.weight, before["markov_w2.weight"])  # W2 still starts at zero
    init_markov_rows(None, drafter.embed_tokens.weight, "embedding")  # a DFlash drafter: nothing to do


def test_an_unknown_start_is_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"train\.markov_init.*random or embedding.*'zeros'"):
        load_config(None, ["train.markov_init=zeros"])
