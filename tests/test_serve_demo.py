"""The demo's bundled data and the SmolLM2 pipeline configs: valid, disjoint, consistent with the target."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dspark_cli.config import load_config

REPO = Path(__file__).resolve().parent.parent
RESOURCES = REPO / "dspark_cli" / "resources"
CONFIGS = ["pipelines/smollm2-135m.toml", "pipelines/smollm2-135m-dflash.toml"]


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (RESOURCES / name).read_text().splitlines() if line.strip()]


def test_bundled_prompts_are_a_few_hundred_and_disjoint_from_eval():
    train = _rows("demo_prompts.jsonl")
    assert 200 <= len(train) <= 600
    assert len({r["id"] for r in train}) == len(train)
    train_turns = {r["turns"][0] for r in train}
    for name in ("demo_eval_gsm8k.jsonl", "demo_eval_humaneval.jsonl"):
        held_out = _rows(name)
        assert len(held_out) == 20 and all(set(r) == {"turns"} for r in held_out)
        assert not train_turns & {r["turns"][0] for r in held_out}, f"{name} overlaps the training prompts"
    sources = {r["id"].split("-")[0] for r in train}
    assert sources == {"gsm8k", "humaneval"}


def test_builder_reproduces_the_committed_files(tmp_path, monkeypatch):
    from dspark_cli.resources import build_demo_sets

    monkeypatch.setattr(build_demo_sets, "HERE", tmp_path)
    build_demo_sets.main()
    for name in ("demo_prompts.jsonl", "demo_eval_gsm8k.jsonl", "demo_eval_humaneval.jsonl"):
        assert (tmp_path / name).read_text() == (RESOURCES / name).read_text(), name


SMOLLM2_LAYERS = 30  # SmolLM2-135M: llama.block_count in the GGUF (checked by the slow test below)


@pytest.mark.parametrize("config", CONFIGS)
def test_pipeline_configs_load_and_match_the_target(config):
    from dspark_cli.target.layers import resolve_layers

    cfg = load_config(str(REPO / config), [])
    # "auto": cache build records these (docs/demo.md); train and eval take them from there
    assert cfg.target.layers == "auto" and resolve_layers("auto", SMOLLM2_LAYERS) == [1, 8, 14, 20, 27]
    assert cfg.target.mask_token_id not in (0, 1, 2)  # not eos/pad/bos of SmolLM2
    assert cfg.regen.serve_target and cfg.model.block_size == 7
    for path in [cfg.data.source, *cfg.eval.datasets]:
        assert (REPO / path).is_file(), path


@pytest.mark.slow
def test_mask_token_and_depth_match_the_real_gguf():
    """Reading the GGUF metadata takes ~10-30 s on 2 loaded cores, hence slow."""
    import gguf

    from dspark_cli.convert import find_smollm2_gguf

    reader = gguf.GGUFReader(find_smollm2_gguf())
    field = reader.fields["tokenizer.ggml.tokens"]
    tokens = [bytes(field.parts[i]).decode() for i in field.data[:64]]
    assert int(reader.fields["llama.block_count"].parts[-1][0]) == SMOLLM2_LAYERS
    for config in CONFIGS:
        cfg = load_config(str(REPO / config), [])
        assert tokens[cfg.target.mask_token_id] == "<empty_output>"  # a special token chat never uses


def test_dspark_and_dflash_differ_only_in_heads_and_loss():
    a, b = (load_config(str(REPO / c), []).to_dict() for c in CONFIGS)
    for section in ("target", "data", "regen", "cache"):
        assert a[section] == b[section], section
    same_budget = ("num_anchors", "lr", "global_batch", "micro_batch", "epochs", "max_steps", "seed",
                   "backbone_init")
    assert {k: a["train"][k] for k in same_budget} == {k: b["train"][k] for k in same_budget}
    assert a["model"]["num_draft_layers"] == b["model"]["num_draft_layers"]
    assert (a["model"]["markov_head_type"], b["model"]["markov_head_type"]) == ("vanilla", "none")
    assert not b["model"]["enable_confidence_head"] and b["train"]["ce_weight"] == 1.0
