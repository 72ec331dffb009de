"""`dspark data prepare`: every input format, broken rows to quarantine, duplicates, the seeded
split, restart semantics (done / conflict / force / kill -9), and memory:// + S3 outputs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dspark_cli import manifest, storage
from dspark_cli.config import load_config
from dspark_cli.data import io
from dspark_cli.data.prepare import prepare, split_of
from dspark_cli.errors import DsparkError, StageConflictError
from dspark_cli.schemas import validate

ROOT = Path(__file__).resolve().parents[1]

SHAREGPT = [
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi there"},
                       {"from": "gpt", "value": "Hello!"}, {"from": "human", "value": "What is 2+2?"},
                       {"from": "gpt", "value": "4"}], "source": "airoboros"},
    {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "chatgpt", "value": "Red"}]},
    {"conversations": [{"from": "human", "value": "Name a colour."}, {"from": "bard", "value": "Blue"}]},
    {"conversations": [{"from": "human", "value": "part one"}, {"from": "human", "value": "part two"},
                       {"from": "gpt", "value": "ok"}]},
]
BROKEN_LINES = [
    '{"conversations": [{"from": "gpt", "value": "I speak first"}]}',          # no user turn
    '{"conversations": [{"from": "human", "value": "   "}]}',                  # empty content
    '{"conversations": [{"from": "wizard", "value": "abracadabra"}]}',         # unknown role
    '{"conversations": [{"from": "human", "value": "cut',                       # undecodable JSON
    '{"text": "no known format"}',                                               # unknown format
]


def _cfg(tmp_path: Path, source: str, *sets: str):
    return load_config(None, [f"data.source={source}", f"pipeline.work_dir={tmp_path / 'work'}", *sets])


def _validate_artifact(url: str) -> list[dict]:
    rows = list(io.read_rows(url))
    for row in rows:
        validate(row, "prompt_row", where=url)
    for row in io.read_file_rows(storage.join(url, "quarantine.parquet")):
        validate(row, "quarantine_row", where=url)
    assert manifest.read_manifest(url) is not None  # validated against stage_manifest
    return rows


def test_sharegpt_jsonl_with_broken_rows(tmp_path):
    src = tmp_path / "chats.jsonl"
    lines = [json.dumps(r) for r in SHAREGPT] + BROKEN_LINES
    src.write_bytes(("\n".join(lines) + "\n").encode() + b'{"turns": ["caf\xe9"]}\n')  # latin-1 byte
    out = str(tmp_path / "prompts")
    result = prepare(_cfg(tmp_path, str(src), "data.val_fraction=0.0"), out)

    rows = _validate_artifact(out)
    assert [r["messages"] for r in rows] == [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
         {"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Name a colour."}],
        [{"role": "user", "content": "part one\n\npart two"}],
    ]
    assert rows[0]["original_assistant"] == ["Hello!", "4"]
    assert rows[0]["source"] == "airoboros" and rows[1]["source"] == "chats"
    assert len({r["id"] for r in rows}) == 3 and all(r["split"] == "train" for r in rows)

    quarantine = io.read_file_rows(storage.join(out, "quarantine.parquet"))
    reasons = [q["reason"] for q in quarantine]
    assert len(quarantine) == 6
    assert any("assistant turn before the first user turn" in r for r in reasons)
    assert any("empty content" in r for r in reasons)
    assert any("unknown role 'wizard'" in r for r in reasons)
    assert any("undecodable JSON" in r for r in reasons)
    assert any("unknown row format" in r for r in reasons)
    assert any("not valid UTF-8" in r for r in reasons)
    assert {q["row"] for q in quarantine} == {5, 6, 7, 8, 9, 10}  # JSON Lines line numbers
    counts = result.counts
    assert (counts["rows"], counts["duplicates"], counts["quarantined"]) == (3, 1, 6)
    assert manifest.read_manifest(out)["counts"]["quarantine_reasons"]["unknown role"] == 1


def test_openai_json_array_and_turns_parquet_with_glob_and_comma_list(tmp_path):
    (tmp_path / "in").mkdir()
    openai_rows = [
        {"id": "oa-1", "messages": [{"role": "developer", "content": "Answer in French."},
                                    {"role": "user", "content": [{"type": "text", "text": "Good "},
                                                                 {"type": "text", "text": "morning"}]},
                                    {"role": "assistant", "content": "Bonjour"}]},
        {"id": "oa-2", "messages": [{"role": "user", "content": "x"}, {"role": "tool", "content": "y"}]},
    ]
    (tmp_path / "in" / "a.json").write_text(json.dumps(openai_rows))
    pq.write_table(pa.Table.from_pylist([{"question_id": 81, "turns": ["Write a poem.", "Now shorter."]},
                                         {"question_id": 82, "turns": []}]), tmp_path / "in" / "b.parquet")
    (tmp_path / "c.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "third"}]}) + "\n")
    out = str(tmp_path / "prompts")
    prepare(_cfg(tmp_path, f"{tmp_path}/in/*, {tmp_path}/c.jsonl"), out)

    rows = {r["id"]: r for r in _validate_artifact(out)}
    assert rows["oa-1"]["messages"] == [{"role": "system", "content": "Answer in French."},
                                        {"role": "user", "content": "Good morning"}]
    assert rows["oa-1"]["original_assistant"] == ["Bonjour"]
    # eval turns stay separate user turns: each gets its own regenerated answer
    assert rows["81"]["messages"] == [{"role": "user", "content": "Write a poem."},
                                      {"role": "user", "content": "Now shorter."}]
    assert len(rows) == 3
    reasons = sorted(q["reason"] for q in io.read_file_rows(storage.join(out, "quarantine.parquet")))
    assert reasons == ["no user turn", "turn 1: unknown role 'tool'"]
    inputs = sorted(Path(i["url"]).name for i in manifest.read_manifest(out)["inputs"])
    assert inputs == ["a.json", "b.parquet", "c.jsonl"]


def test_duplicate_id_with_other_prompt_is_quarantined(tmp_path):
    src = tmp_path / "ids.jsonl"
    src.write_text("\n".join(json.dumps({"id": "same", "turns": [t]}) for t in ("one", "two")) + "\n")
    out = str(tmp_path / "p")
    result = prepare(_cfg(tmp_path, str(src)), out)
    assert [r["id"] for r in io.read_rows(out)] == ["same"]
    assert result.counts["quarantined"] == 1
    assert "duplicate id 'same'" in io.read_file_rows(storage.join(out, "quarantine.parquet"))[0]["reason"]


def _many(tmp_path: Path, n: int) -> Path:
    src = tmp_path / "many.jsonl"
    src.write_text("".join(json.dumps({"turns": [f"question number {i}?"]}) + "\n" for i in range(n)))
    return src


def test_split_is_seeded_deterministic_and_limit_shards(tmp_path):
    src = _many(tmp_path, 400)
    a = prepare(_cfg(tmp_path, str(src), "data.val_fraction=0.25", "data.shard_rows=64"), str(tmp_path / "a"))
    prepare(_cfg(tmp_path, str(src), "data.val_fraction=0.25", "data.shard_rows=64"), str(tmp_path / "b"))
    rows_a, rows_b = list(io.read_rows(str(tmp_path / "a"))), list(io.read_rows(str(tmp_path / "b")))
    assert rows_a == rows_b
    assert a.counts["shards"] == 7 and len(io.list_shards(str(tmp_path / "a" / "data"))) == 7
    assert 70 <= a.counts["validation"] <= 130  # 25 % of 400, binomial sd ≈ 8.7
    val = list(io.read_rows(str(tmp_path / "a"), split="validation"))
    assert len(val) == a.counts["validation"] and all(r["split"] == "validation" for r in val)
    assert all(split_of(r["id"], 0, 0.25) == r["split"] for r in rows_a)
    c = prepare(_cfg(tmp_path, str(src), "data.val_fraction=0.25", "data.seed=1"), str(tmp_path / "c"))
    assert [r["split"] for r in io.read_rows(str(tmp_path / "c"))] != [r["split"] for r in rows_a]
    assert c.counts["validation"] != a.counts["validation"] or c.counts != a.counts
    d = prepare(_cfg(tmp_path, str(src), "data.limit=10"), str(tmp_path / "d"))
    assert d.counts["rows"] == 10 and [r["id"] for r in io.read_rows(str(tmp_path / "d"))] == \
        [r["id"] for r in rows_a[:10]]


def test_rerun_done_conflict_and_force(tmp_path):
    src = _many(tmp_path, 20)
    out = str(tmp_path / "p")
    assert prepare(_cfg(tmp_path, str(src)), out).state == "fresh"
    first = storage.read_bytes(storage.join(out, "manifest.json"))
    assert prepare(_cfg(tmp_path, str(src)), out).state == "done"
    assert storage.read_bytes(storage.join(out, "manifest.json")) == first
    with pytest.raises(StageConflictError, match=r"config key data\.val_fraction"):
        prepare(_cfg(tmp_path, str(src), "data.val_fraction=0.5"), out)
    src.write_text(src.read_text() + json.dumps({"turns": ["one more"]}) + "\n")
    with pytest.raises(StageConflictError, match=r"another input /"):
        prepare(_cfg(tmp_path, str(src)), out)
    assert prepare(_cfg(tmp_path, str(src)), out, force=True).counts["rows"] == 21


def test_no_usable_row_is_one_error_and_leaves_nothing(tmp_path):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": 1}\n')
    out = tmp_path / "p"
    with pytest.raises(DsparkError, match="no usable conversation"):
        prepare(_cfg(tmp_path, str(src)), str(out))
    assert not out.exists() or list(out.iterdir()) == []
    with pytest.raises(DsparkError, match="matches no file"):
        prepare(_cfg(tmp_path, f"{tmp_path}/nothing-*.jsonl"), str(out))


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_object_store_output(tmp_path, where, request):
    root = request.getfixturevalue("memory_url" if where == "memory" else "s3_bucket")
    lines = _many(tmp_path, 30).read_text().splitlines(keepends=True)
    storage.write_text(storage.join(root, "in", "a.jsonl"), "".join(lines[:20]))
    storage.write_text(storage.join(root, "in", "b.jsonl"), "".join(lines[20:]))
    source = storage.join(root, "in", "*.jsonl")  # inputs on the object store too
    out = storage.join(root, "prompts")
    result = prepare(_cfg(tmp_path, source, "data.shard_rows=8"), out)
    rows = _validate_artifact(out)
    assert len(rows) == 30 == result.counts["rows"] and result.counts["shards"] == 4
    assert len(manifest.read_manifest(out)["inputs"]) == 2
    assert prepare(_cfg(tmp_path, source, "data.shard_rows=8"), out).state == "done"


def _cli(*args: str, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_cli.cli", *args], capture_output=True, text=True,
                          cwd=ROOT, env={**os.environ, **(env or {})}, timeout=120, **kw)


def test_cli_prepare_and_one_line_errors(tmp_path):
    src = _many(tmp_path, 12)
    out = tmp_path / "p"
    done = _cli("data", "prepare", "--source", str(src), "--output", str(out), "--val-fraction", "0.5")
    assert done.returncode == 0, done.stderr
    assert "prompts: 12" in done.stdout
    again = _cli("data", "prepare", "--source", str(src), "--output", str(out), "--val-fraction", "0.5")
    assert again.returncode == 0 and "nothing to do" in again.stderr
    bad = _cli("data", "prepare", "--source", str(src), "--output", str(out), "--val-fraction", "1.5")
    assert bad.returncode == 2
    assert bad.stderr.startswith("error: --val-fraction: data.val_fraction must be in [0, 1)")
    conflict = _cli("data", "prepare", "--source", str(src), "--output", str(out), "--val-fraction", "0.1")
    assert conflict.returncode == 2
    assert "data.val_fraction" in conflict.stderr and "--force" in conflict.stderr
    assert "Traceback" not in bad.stderr + conflict.stderr


def test_hub_dataset_unreachable_is_one_line(tmp_path):
    res = _cli("data", "prepare", "--source", "dspark-test/no-such-dataset", "--output", str(tmp_path / "p"),
               env={"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")})
    assert res.returncode == 2
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith(("error:", "hint:"))]
    assert lines[0].startswith("error: could not load Hugging Face dataset 'dspark-test/no-such-dataset'")
    assert "Traceback" not in res.stderr
    assert not (tmp_path / "p" / "_run.json").exists()


def test_kill9_midway_then_rerun_gives_the_same_artifact(tmp_path):
    src = _many(tmp_path, 3000)
    ref = prepare(_cfg(tmp_path, str(src), "data.shard_rows=5"), str(tmp_path / "ref"))
    out = tmp_path / "p"
    args = ["data", "prepare", "--source", str(src), "--output", str(out), "--shard-rows", "5"]
    proc = subprocess.Popen([sys.executable, "-m", "dspark_cli.cli", *args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline and len(list((out / "data").glob("part-*"))) < 3:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "manifest.json").exists(), "killed too late: the run had already finished"
    assert _cli(*args).returncode == 0
    assert list(io.read_rows(str(out))) == list(io.read_rows(str(tmp_path / "ref")))
    assert manifest.read_manifest(str(out))["counts"]["rows"] == ref.counts["rows"] == 3000
    assert not [p for p in out.rglob("*") if p.name.startswith(storage.TMP_PREFIX)]


def test_hub_reader_streams_a_datasets_repo(tmp_path):
    """The hub path (datasets.load_dataset, streaming) on a local dataset folder, as it would read
    mlabonne/open-perfectblend (ShareGPT rows with a `source` column)."""
    from dspark_cli.data import sources
    from dspark_cli.data.formats import normalise

    repo = tmp_path / "blend"
    (repo / "data").mkdir(parents=True)
    rows = [{"conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}],
             "source": "gsm8k"} for i in range(5)]
    pq.write_table(pa.Table.from_pylist(rows), repo / "data" / "train-00000-of-00001.parquet")
    raw = list(sources.read_hub(str(repo), "train"))
    assert [r.index for r in raw] == [0, 1, 2, 3, 4] and raw[0].input == f"hf://{repo}[train]"
    conv = normalise(raw[3].row)
    assert conv.messages == [{"role": "user", "content": "q3"}] and conv.source == "gsm8k"
    with pytest.raises(DsparkError, match="could not load Hugging Face dataset"):
        sources.read_hub(str(repo), "no-such-split")


def test_seen_keys_match_a_dict_across_merges():
    """The compact de-duplication set answers as a dict would, before and after its merges."""
    import random

    from dspark_cli.data.seen import SeenKeys, key64

    rng = random.Random(0)
    seen, ref = SeenKeys(values=True, pending_limit=7), {}
    for i in range(500):
        key = rng.getrandbits(64) if i % 3 else key64(f"id-{i % 40}")  # repeats, and keys ≥ 2^63
        if key not in ref:
            ref[key] = i
            seen.add(key, i)
        assert seen.get(key) == ref[key] and key in seen
    assert len(seen) == len(ref)
    assert all(seen.get(k) == v for k, v in ref.items())
    assert seen.get(rng.getrandbits(64)) is None and 2**64 - 1 not in seen
    plain = SeenKeys(pending_limit=2)
    plain.add(5)
    plain.add(2**63 + 1)
    assert 5 in plain and 2**63 + 1 in plain and 6 not in plain and plain.get(5) == 0


def test_streamed_reads_keep_line_numbers_for_crlf_cr_bom_and_gzip(tmp_path):
    """Files are read line by line now: CRLF, bare-CR and BOM files, gzipped or not, give the same
    rows and the same line numbers as a whole-file `splitlines` did."""
    import gzip

    from dspark_cli.data import sources

    lines = [json.dumps({"turns": [f"question {i}"]}).encode() for i in range(4)]
    body = b"\xef\xbb\xbf" + lines[0] + b"\r\n\r\n" + lines[1] + b"\r{broken\n" + lines[2] + b"\n" + lines[3]
    (tmp_path / "a.jsonl").write_bytes(body)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(body))
    whole = [i + 1 for i, line in enumerate(body[3:].splitlines()) if line.strip()]  # the old numbering
    for name in ("a.jsonl", "b.jsonl.gz"):
        rows = list(sources.read_local(str(tmp_path / name)))
        assert [r.index for r in rows] == whole == [1, 3, 4, 5, 6]
        assert [r.error is None for r in rows] == [True, True, False, True, True]
        assert rows[0].row == {"turns": ["question 0"]} and "undecodable JSON" in rows[2].error
