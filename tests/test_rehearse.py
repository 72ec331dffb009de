"""`make rehearse`'s building blocks at toy size: the random-weights target (bf16, shard by shard,
a folder Transformers loads as Qwen3), the reference-answer responses, and the per-stage
seconds/peak-RSS measurement. The full rehearsal is `make rehearse`, not part of `make test`."""

from __future__ import annotations

import json
import re
import sys

import pytest
import torch
from safetensors import safe_open

from benchmarks import random_target
from benchmarks.reference_responses import response_rows, write_responses
from benchmarks.rehearse import run_stage

SHAPE = {"model_type": "qwen3", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 3,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 400,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
         "tie_word_embeddings": True}


def test_random_target_is_a_qwen3_transformers_loads_written_in_bf16_shards(tmp_path, tiny_qwen3_target):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "target"
    random_target.write_random_target(out, SHAPE, str(tiny_qwen3_target), shard_bytes=40_000)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 3  # written shard by shard, none over the limit unless one tensor is
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        assert all(t.dtype == torch.bfloat16 for t in tensors.values())
        assert len(tensors) == 1 or sum(t.numel() * 2 for t in tensors.values()) <= 40_000
        assert {index["weight_map"][k] for k in tensors} == {shard.name}
    config = AutoConfig.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert config.architectures == ["Qwen3ForCausalLM"] and config.tie_word_embeddings
    assert config.eos_token_id == tokenizer.eos_token_id and config.vocab_size == 400
    model, info = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    norm = model.model.layers[0].input_layernorm.weight
    proj = model.model.layers[2].mlp.down_proj.weight
    assert torch.equal(norm, torch.ones_like(norm))
    assert abs(proj.float().std().item() - random_target.INIT_STD) < 0.005
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_random_target_is_reused_and_a_killed_write_is_not(tmp_path, tiny_qwen3_target):
    out = tmp_path / "target"
    random_target.write_random_target(out, SHAPE, str(tiny_qwen3_target))
    marker = out / random_target.MARKER
    first = marker.stat().st_mtime_ns
    random_target.write_random_target(out, SHAPE, str(tiny_qwen3_target))
    assert marker.stat().st_mtime_ns == first  # same spec: reused
    marker.unlink()  # as if killed before the marker: rewritten whole
    (tmp_path / "target.partial").mkdir()
    random_target.write_random_target(out, SHAPE, str(tiny_qwen3_target), seed=1)
    assert json.loads(marker.read_text())["seed"] == 1 and not (tmp_path / "target.partial").exists()


def test_reference_responses_pair_bundled_prompts_with_their_datasets_answers(tmp_path):
    import pyarrow.parquet as pq

    rows = response_rows(16, validation_every=4)
    assert [r["split"] for r in rows].count("validation") == 4
    for r in rows:
        user, answer = r["messages"]
        assert user["role"] == "user" and answer["role"] == "assistant"
        if r["id"].startswith("gsm8k"):
            assert "\\boxed{" in answer["content"] and "<<" not in answer["content"]
        else:
            assert r["id"].startswith("humaneval")
            assert answer["content"].startswith("Here is a solution:\n```python")
            assert "\ndef " in answer["content"] and answer["content"].endswith("```")
    write_responses(str(tmp_path / "responses"), rows, per_file=5)
    files = sorted((tmp_path / "responses" / "data").glob("*.parquet"))
    assert len(files) == 4
    assert [x for f in files for x in pq.read_table(f).column("id").to_pylist()] == [r["id"] for r in rows]


def test_a_stage_line_reports_the_childs_own_peak_rss(tmp_path, capsys):
    cmd = [sys.executable, "-c", "import time; b = bytearray(300 * 2**20); b[::4096] = b'x' * len(b[::4096])"]
    stage = run_stage("probe", cmd, tmp_path, {})
    line = capsys.readouterr().out.strip().splitlines()[0]
    assert re.fullmatch(r"rehearse probe seconds=\d+\.\d peak_rss_mb=\d+", line)
    assert stage.rc == 0 and 300 <= stage.peak_rss_mb < 600
    failed = run_stage("fails", [sys.executable, "-c", "raise SystemExit(3)"], tmp_path, {})
    assert failed.rc == 3 and "FAILED rc=3" in capsys.readouterr().out


@pytest.mark.parametrize("limit", [40_000, 10**9])
def test_shards_keep_order_and_cover_every_tensor(limit):
    shapes = {f"t{i}": (100, 50 + i) for i in range(7)}
    shards = random_target.plan_shards(shapes, limit)
    assert [n for s in shards for n in s] == list(shapes)
    assert len(shards) == (1 if limit == 10**9 else 3)  # ~10 kB each: three to a 40 kB shard
