"""The fresh drafter's final-norm gain (train.init_output_gain): matched to the target's spread."""

from __future__ import annotations

import pytest
import torch
from fixtures.drafter import drafter_config, make_samples

from dspark_cli.config import load_config
from dspark_cli.errors import ConfigError
from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.model.frozen import attach_frozen
from dspark_cli.model.init_gain import logit_std, matched_gain, reference_states, set_output_gain


@pytest.fixture(scope="module")
def samples(tiny_qwen3_target):
    return make_samples(tiny_qwen3_target, n=4)


def fresh(target) -> DSparkDrafter:
    torch.manual_seed(0)
    drafter = DSparkDrafter(drafter_config(target))
    attach_frozen(drafter, str(target))
    return drafter


def mask_logit_std(drafter: DSparkDrafter) -> float:
    row = drafter.embed_tokens.weight[drafter.config.mask_token_id].float().unsqueeze(0)
    with torch.no_grad():
        return logit_std(drafter.lm_head.weight, drafter.norm(row))


def test_auto_gives_the_mask_slot_the_targets_logit_spread(tiny_qwen3_target, samples):
    drafter = fresh(tiny_qwen3_target)
    states = reference_states(samples)
    target_std = logit_std(drafter.lm_head.weight, states)
    # Make the target's states 4x flatter than the drafter's read-back of its mask token.
    flat = states * (0.25 * mask_logit_std(drafter) / target_std)
    chosen = matched_gain(drafter, flat)
    assert chosen.gain == pytest.approx(0.25, rel=1e-3)
    assert torch.all(drafter.norm.weight == 1)  # matched_gain only measures
    drafter.norm.weight.data.fill_(chosen.gain)
    assert mask_logit_std(drafter) == pytest.approx(logit_std(drafter.lm_head.weight, flat), rel=1e-3)


def test_auto_never_raises_the_gain_above_one(tiny_qwen3_target, samples):
    drafter = fresh(tiny_qwen3_target)
    sharp = reference_states(samples) * 100
    assert matched_gain(drafter, sharp).gain == 1.0


def test_set_output_gain_writes_the_norm(tiny_qwen3_target, samples):
    drafter = fresh(tiny_qwen3_target)
    auto = set_output_gain(drafter, "auto", samples)
    assert auto.target_logit_std is not None and 0 < auto.gain <= 1
    assert torch.all(drafter.norm.weight == auto.gain)
    fixed = set_output_gain(drafter, 0.5, samples)
    assert fixed.to_dict() == {"gain": 0.5, "target_logit_std": None, "init_logit_std": None}
    assert torch.all(drafter.norm.weight == 0.5)


@pytest.mark.parametrize(("value", "message"), [("loud", 'must be "auto" or a number'),
                                                ("0", r"must be in \(0, 10\]")])
def test_bad_setting_names_the_key(value, message):
    with pytest.raises(ConfigError, match=f"train.init_output_gain {message}"):
        load_config(None, [f"train.init_output_gain={value}"])
