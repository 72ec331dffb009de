"""`dspark data regen` against a real fake-OpenAI server process: answers turn by turn, sampling and
thinking sent and recorded, faults retried, policies, errors and --retry-errors, the start-up probe,
and exactly-once output after SIGKILL (local disk, memory://, S3)."""

from __future__ import annotations

import json
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from fixtures.openai_server import answer_for, reasoning_for, start_openai_server

from dspark_cli import manifest, storage
from dspark_cli.config import load_config
from dspark_cli.data import io
from dspark_cli.data.faults import Failure, RetryPolicy
from dspark_cli.data.prepare import prepare
from dspark_cli.data.regen import regen
from dspark_cli.data.store import ResponseStore
from dspark_cli.errors import DsparkError, StageConflictError, StageFailed
from dspark_cli.schemas import validate

ROOT = Path(__file__).resolve().parents[1]
MODEL = "fixture-model"
FAST_RETRY = ["regen.retry_base_delay=0.01", "regen.retry_max_delay=0.2"]


@pytest.fixture(scope="module")
def openai_server():
    """One fake OpenAI server process for the module."""
    with start_openai_server(model=MODEL) as server:
        yield server


@pytest.fixture
def fixture_server(openai_server):
    """The module's server with faults off and counters cleared."""
    openai_server.reset()
    return openai_server


def _settle(server, quiet_s: float = 0.3, limit_s: float = 5.0) -> None:
    """Wait until the server has seen no new request for quiet_s: a failed run's requests that
    were in flight when it stopped still land, and must not count after a reset."""
    def seen() -> tuple[int, int]:
        stats = server.stats()
        return stats["requests"], stats["completions"]

    last, since, stop = seen(), time.monotonic(), time.monotonic() + limit_s
    while time.monotonic() < stop and time.monotonic() - since < quiet_s:
        time.sleep(0.05)
        now = seen()
        if now != last:
            last, since = now, time.monotonic()


def _prompts(tmp_path: Path, n: int, extra: list[dict] | None = None) -> str:
    """A prepared prompts artifact of n conversations (every 5th multi-turn with a system turn)."""
    src = tmp_path / "chats.jsonl"
    with src.open("w") as f:
        for i in range(n):
            if i % 5 == 0:
                row = {"id": f"c{i:04d}", "messages": [
                    {"role": "system", "content": f"You are assistant {i}."},
                    {"role": "user", "content": f"Question {i}?"}, {"role": "assistant", "content": "old"},
                    {"role": "user", "content": f"And a follow-up to {i}?"}]}
            else:
                row = {"id": f"c{i:04d}", "turns": [f"Prompt number {i}: explain."]}
            f.write(json.dumps(row) + "\n")
        for row in extra or []:
            f.write(json.dumps(row) + "\n")
    out = str(tmp_path / "prompts")
    prepare(load_config(None, [f"data.source={src}", "data.val_fraction=0.2"]), out)
    return out


def _cfg(server, *sets: str):
    return load_config(None, [f"regen.endpoints=['{server.url}']", f"regen.model={MODEL}",
                              *FAST_RETRY, *sets])


def expected_messages(prompt_messages: list[dict], max_tokens: int = 2048) -> list[dict]:
    """What regen must produce: each user turn answered by the server, seeing the answered history."""
    history: list[dict] = []
    for m in prompt_messages:
        history.append({"role": m["role"], "content": m["content"]})
        if m["role"] == "user":
            history.append({"role": "assistant", "content": answer_for(history, max_tokens)[0]})
    return history


def _check_complete(prompts_url: str, out_url: str, max_tokens: int = 2048) -> list[dict]:
    """Every prompt exactly once in data (or errors), each answer what the server gives."""
    prompts = {r["id"]: r for r in io.read_rows(prompts_url)}
    rows = list(io.read_rows(out_url))
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)), "an id appears twice in the output"
    errors = io.read_file_rows(storage.join(out_url, "errors.parquet"))
    rejected = io.read_file_rows(storage.join(out_url, "rejected.parquet"))
    settled = set(ids) | {e["id"] for e in errors} | {r["id"] for r in rejected}
    assert len(settled) == len(ids) + len(errors) + len(rejected), "an id is in two of data/errors/rejected"
    assert settled == set(prompts)
    for row in rows:
        validate(row, "response_row", where=out_url)
        assert row["messages"] == expected_messages(prompts[row["id"]]["messages"], max_tokens)
        assert row["split"] == prompts[row["id"]]["split"]
    for row in errors:
        validate(row, "regen_error_row", where=out_url)
    for row in rejected:
        validate(row, "rejected_row", where=out_url)
    return rows


def test_regen_turn_by_turn_records_sampling_and_thinking(tmp_path, fixture_server, monkeypatch):
    monkeypatch.setenv("DSPARK_TEST_KEY", "sk-test-secret-123")
    prompts = _prompts(tmp_path, 10)
    cfg = _cfg(fixture_server, "regen.thinking=true", "regen.temperature=0.6", "regen.top_k=7",
               "regen.min_p=0.05", "regen.max_tokens=64", "regen.api_key_env=DSPARK_TEST_KEY")
    out = str(tmp_path / "responses")
    result = regen(cfg, prompts, out)

    rows = _check_complete(prompts, out, max_tokens=64)
    assert len(rows) == 10 and result.counts["responses"] == 10
    multi = next(r for r in rows if r["id"] == "c0000")
    assert [m["role"] for m in multi["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert multi["reasoning"] == [reasoning_for(multi["messages"][:2]), reasoning_for(multi["messages"][:4])]
    assert multi["finish_reasons"] == ["stop", "stop"] and multi["thinking"] is True
    assert multi["model"] == MODEL and multi["endpoint"] == fixture_server.url
    assert json.loads(multi["sampling"]) == {"temperature": 0.6, "top_p": 0.8, "top_k": 7, "min_p": 0.05,
                                             "max_tokens": 64, "enable_thinking": True}
    assert multi["completion_tokens"] == sum(len(m["content"].split()) for m in multi["messages"]
                                             if m["role"] == "assistant")
    sent = fixture_server.requests()
    assert len(sent) == 12  # 2 multi-turn conversations × 2 + 8 single
    body = sent[0]["body"]
    assert (body["temperature"], body["top_p"], body["top_k"], body["min_p"], body["max_tokens"]) == \
        (0.6, 0.8, 7, 0.05, 64)
    assert body["chat_template_kwargs"] == {"enable_thinking": True}
    assert {s["authorization"] for s in sent} == {"Bearer sk-test-secret-123"}
    for path in Path(out).rglob("*"):  # the key is never written anywhere
        if path.is_file():
            assert b"sk-test-secret-123" not in path.read_bytes(), path
    m = manifest.read_manifest(out)
    assert m["extra"]["api_key_env"] == "DSPARK_TEST_KEY" and m["counts"]["errors"] == 0
    assert regen(cfg, prompts, out).state == "done"
    with pytest.raises(StageConflictError, match=r"config key regen\.temperature"):
        regen(_cfg(fixture_server, "regen.temperature=0.9", "regen.thinking=true", "regen.top_k=7",
                   "regen.min_p=0.05", "regen.max_tokens=64", "regen.api_key_env=DSPARK_TEST_KEY"),
              prompts, out)


def test_transient_faults_are_retried_until_every_answer_is_right(tmp_path, fixture_server):
    fixture_server.set_faults(error_500=0.1, rate_limit_429=0.08, retry_after=0.05, drop=0.06,
                              malformed=0.06, slow=0.05, slow_seconds=1.5, seed=3)
    prompts = _prompts(tmp_path, 60)
    out = str(tmp_path / "responses")
    result = regen(_cfg(fixture_server, "regen.max_retries=12", "regen.request_timeout=0.8",
                        "regen.concurrency=8", "regen.batch_rows=10"), prompts, out)
    rows = _check_complete(prompts, out)
    assert len(rows) == 60 and result.counts["errors"] == 0
    faults = fixture_server.stats()["faults"]
    kinds = ("error_500", "rate_limit_429", "drop", "malformed")
    assert all(faults.get(k, 0) > 0 for k in (*kinds, "slow")), faults
    # each of these failed one request (a slow reply may also be dropped, so it is not added)
    assert result.counts["retries_this_run"] >= sum(faults[k] for k in kinds)
    assert len(io.list_shards(storage.join(out, "data"))) >= 6  # batches of ≤ 10 rows


def test_truncated_and_empty_answers_follow_the_policy(tmp_path, fixture_server):
    extra = [{"id": "t1", "turns": ["Say a lot [truncate]"]}, {"id": "e1", "turns": ["Say nothing [empty]"]},
             {"id": "t2", "turns": ["First [truncate]", "never asked"]}]
    prompts = _prompts(tmp_path, 4, extra)
    out = str(tmp_path / "drop")
    counts = regen(_cfg(fixture_server), prompts, out).counts
    assert (counts["responses"], counts["rejected_truncated"], counts["rejected_empty"]) == (4, 2, 1)
    rejected = {r["id"]: r for r in io.read_file_rows(storage.join(out, "rejected.parquet"))}
    assert rejected["t1"]["reason"] == "truncated" and rejected["e1"]["reason"] == "empty"
    assert rejected["t2"]["finish_reasons"] == ["length"] and len(rejected["t2"]["messages"]) == 2
    _check_complete(prompts, out)

    kept = str(tmp_path / "keep")
    keep = _cfg(fixture_server, "regen.keep_truncated=true", "regen.keep_empty=true")
    counts = regen(keep, prompts, kept).counts
    assert (counts["responses"], counts["rejected"]) == (7, 0)
    rows = {r["id"]: r for r in _check_complete(prompts, kept)}
    assert rows["t2"]["finish_reasons"] == ["length", "stop"] and rows["e1"]["messages"][-1]["content"] == ""


def test_client_errors_recorded_and_retry_errors_reruns_only_them(tmp_path, fixture_server):
    extra = [{"id": "bad1", "turns": ["Refuse me [bad-request]"]}]
    prompts = _prompts(tmp_path, 12, extra)
    out = str(tmp_path / "responses")
    fixture_server.set_faults(error_500=1.0)  # every request fails: retries run out
    with pytest.raises(StageFailed, match=r"no usable response from 13 prompts \(13 failed.*most common "
                                          r"\(12×\): server_error 500: injected server error"):
        regen(_cfg(fixture_server, "regen.max_retries=1", "regen.fail_fast_after=0"), prompts, out)
    assert manifest.read_manifest(out) is None  # a run that answered nothing is not done
    errors = {e["id"]: e for e in io.read_file_rows(storage.join(out, "errors.parquet"))}
    assert errors["bad1"]["status_code"] == 400 and errors["bad1"]["attempts"] == 1
    assert errors["bad1"]["message"] == "fixture refuses prompts marked [bad-request]"
    assert errors["c0001"]["kind"] == "server_error" and errors["c0001"]["attempts"] == 2
    assert errors["c0001"]["message"] == "injected server error"

    fixture_server.reset()  # the corrected rerun may change anything (here max_tokens) without --force
    counts = regen(_cfg(fixture_server, "regen.max_retries=1", "regen.max_tokens=512"), prompts, out).counts
    assert (counts["responses"], counts["errors"]) == (12, 1)  # the abandoned run was redone whole
    assert manifest.read_manifest(out) is not None  # finished, with an error to retry
    fixture_server.reset()
    cfg = _cfg(fixture_server, "regen.max_retries=1", "regen.max_tokens=512")
    assert regen(cfg, prompts, out).state == "done"
    assert fixture_server.stats()["requests"] == 0  # a plain rerun of a finished stage retries nothing
    counts = regen(cfg, prompts, out, retry_errors=True).counts
    assert (counts["responses"], counts["errors"]) == (12, 1)
    assert fixture_server.stats()["requests"] == 1  # only the refused prompt
    rows = _check_complete(prompts, out, max_tokens=512)
    assert len(rows) == 12
    assert [e["id"] for e in io.read_file_rows(storage.join(out, "errors.parquet"))] == ["bad1"]
    leftover = [row for shard in io.list_shards(storage.join(out, "errors"))
                for row in io.read_file_rows(shard)]
    assert [r["id"] for r in leftover] == ["bad1"]  # resolved records pruned from the batch files


def test_error_share_above_the_limit_fails_and_the_rerun_retries_only_the_failed(tmp_path, fixture_server):
    prompts = _prompts(tmp_path, 20)
    out = str(tmp_path / "responses")
    fixture_server.set_faults(error_500=0.5, seed=4)
    with pytest.raises(StageFailed, match=r"(\d+) of 20 prompts failed, more than --max-error-share 0.2"):
        regen(_cfg(fixture_server, "regen.max_retries=0", "regen.max_error_share=0.2"), prompts, out)
    assert manifest.read_manifest(out) is None
    kept = ResponseStore(out).scan()
    assert kept.ok and not kept.errors  # answers kept; the failures are not settled
    fixture_server.set_faults()
    _settle(fixture_server)
    fixture_server.reset()
    cfg = _cfg(fixture_server, "regen.max_retries=0", "regen.max_error_share=0.2")
    counts = regen(cfg, prompts, out).counts
    assert (counts["responses"], counts["errors"]) == (20, 0)
    turns = {f"c{i:04d}": 2 if i % 5 == 0 else 1 for i in range(20)}
    assert fixture_server.stats()["completions"] == sum(n for i, n in turns.items() if i not in kept.ok)
    _check_complete(prompts, out)


def test_retry_after_is_honoured_and_bounded(tmp_path, fixture_server):
    prompts = _prompts(tmp_path, 1)
    fixture_server.set_faults(rate_limit_429=1.0, retry_after=0.3)
    out = str(tmp_path / "responses")
    start = time.monotonic()
    cfg = _cfg(fixture_server, "regen.max_retries=2", "regen.retry_max_delay=5")
    with pytest.raises(StageFailed, match="rate_limit 429: injected rate limit"):  # its only prompt failed
        regen(cfg, prompts, out)
    elapsed = time.monotonic() - start
    assert elapsed >= 0.6  # two waits of at least Retry-After
    assert fixture_server.stats()["faults"]["rate_limit_429"] == 3  # 1 try + 2 retries, then recorded
    error = io.read_file_rows(storage.join(out, "errors.parquet"))[0]
    assert (error["kind"], error["status_code"], error["attempts"]) == ("rate_limit", 429, 3)


def test_retry_policy_backoff_jitter_and_cap():
    policy = RetryPolicy(max_retries=3, base_delay=1.0, max_delay=10.0)
    rng = random.Random(0)
    transient = Failure("server_error", True, "boom", 500)
    for attempt, (low, high) in enumerate([(0.5, 1.0), (1.0, 2.0), (2.0, 4.0), (4.0, 8.0), (5.0, 10.0)]):
        delays = [policy.delay(attempt, transient, rng) for _ in range(200)]
        assert low <= min(delays) and max(delays) <= high and max(delays) - min(delays) > (high - low) / 2
    assert policy.delay(0, Failure("rate_limit", True, "", 429, retry_after=7.0), rng) == 7.0
    assert policy.delay(0, Failure("rate_limit", True, "", 429, retry_after=99.0), rng) == 10.0
    assert policy.should_retry(2, transient) and not policy.should_retry(3, transient)
    assert not policy.should_retry(0, Failure("http_status", False, "bad", 400))


def test_probe_fails_fast_with_one_line(tmp_path, fixture_server):
    prompts = _prompts(tmp_path, 2)
    with pytest.raises(DsparkError, match=r"model 'other' is not served by .*it serves: fixture-model"):
        regen(load_config(None, [f"regen.endpoints=['{fixture_server.url}']", "regen.model=other"]),
              prompts, str(tmp_path / "r1"))
    dead = "http://127.0.0.1:9/v1"
    with pytest.raises(DsparkError, match=r"no endpoint answered GET /models: http://127.0.0.1:9/v1"):
        regen(load_config(None, [f"regen.endpoints=['{dead}']", f"regen.model={MODEL}"]), prompts,
              str(tmp_path / "r2"))
    # one dead endpoint among live ones is skipped with a warning
    cfg = load_config(None, [f"regen.endpoints=['{dead}', '{fixture_server.url}']", f"regen.model={MODEL}"])
    assert regen(cfg, prompts, str(tmp_path / "r3")).counts["responses"] == 2
    res = subprocess.run([sys.executable, "-m", "dspark_cli.cli", "data", "regen", "-i", prompts, "-o",
                          str(tmp_path / "r4"), "--endpoint", fixture_server.url, "--model", "nope"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert "error: model 'nope' is not served by" in res.stderr
    assert "as --model (regen.model in a config)" in res.stderr


@pytest.mark.parametrize("where", ["memory", "s3"])
def test_object_store_output(tmp_path, fixture_server, where, request):
    root = request.getfixturevalue("memory_url" if where == "memory" else "s3_bucket")
    prompts = _prompts(tmp_path, 25)
    out = storage.join(root, "responses")
    fixture_server.set_faults(error_500=0.2, seed=1)
    counts = regen(_cfg(fixture_server, "regen.batch_rows=7", "regen.max_retries=10"), prompts, out).counts
    assert counts["responses"] == 25 and counts["shards"] == 4
    _check_complete(prompts, out)


def _regen_cli(prompts: str, out: str, server, *extra: str) -> list[str]:
    return [sys.executable, "-m", "dspark_cli.cli", "data", "regen", "-i", prompts, "-o", out,
            "--endpoint", server.url, "--model", MODEL, "--concurrency", "8", "--batch-rows", "16",
            "--max-retries", "10", "--request-timeout", "2", *(f"--set={s}" for s in FAST_RETRY), *extra]


def test_sigkill_midrun_then_rerun_is_exactly_once(tmp_path, openai_server):
    openai_server.reset()
    openai_server.set_faults(error_500=0.08, rate_limit_429=0.05, retry_after=0.05, drop=0.04,
                             malformed=0.04, slow=0.03, slow_seconds=0.3, delay=0.01, seed=11)
    extra = [{"id": f"bad{i}", "turns": [f"refused {i} [bad-request]"]} for i in range(3)]
    prompts = _prompts(tmp_path, 300, extra)
    out = tmp_path / "responses"
    cmd = _regen_cli(prompts, str(out), openai_server)
    for kill_after_shards in (4, 10):  # kill twice, at different points
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and \
                len(list((out / "data").glob("part-*.parquet"))) < kill_after_shards:
            time.sleep(0.005)
        assert proc.poll() is None, "regen finished before it could be killed"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (out / "manifest.json").exists()
    settled = ResponseStore(str(out)).scan().settled
    assert 0 < len(settled) < 303
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"{303 - len(settled)} of 303 prompts to do" in done.stderr  # committed ones are skipped
    rows = _check_complete(prompts, str(out))
    assert len(rows) == 300
    errors = io.read_file_rows(str(out / "errors.parquet"))
    assert sorted(e["id"] for e in errors) == ["bad0", "bad1", "bad2"]
    assert manifest.read_manifest(str(out))["counts"]["responses"] == 300
    assert not [p for p in out.rglob("*") if p.name.startswith(storage.TMP_PREFIX)]


def test_progress_line_has_done_rates_errors_and_eta():
    from io import StringIO

    from rich.console import Console

    from dspark_cli.data.progress import RegenCounters, RegenProgress

    buffer = StringIO()
    counters = RegenCounters()
    progress = RegenProgress(10, counters, enabled=True, console=Console(file=buffer, force_terminal=True,
                                                                         width=200))
    with progress:
        counters.done, counters.requests, counters.completion_tokens, counters.errors = 4, 5, 50, 1
        progress.update(force=True)
    shown = buffer.getvalue()
    assert "4/10" in shown and "req/s" in shown and "tok/s" in shown and "errors 1" in shown
    status = progress.status()
    assert status.startswith("4/10 done,") and "errors 1" in status and "ETA" in status


def test_store_views_hide_resolved_errors_and_never_reuse_a_batch_index(memory_url):
    store = ResponseStore(memory_url)
    base = {"source": "s", "split": "train"}
    err = {**base, "kind": "server_error", "status_code": 500, "message": "boom", "endpoint": "e",
           "turn": 0, "attempts": 3}
    ok = {**base, "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
          "reasoning": [None], "thinking": False, "model": "m", "endpoint": "e", "sampling": "{}",
          "finish_reasons": ["stop"], "prompt_tokens": 1, "completion_tokens": 1}
    store.write_batch(0, [{**ok, "id": "a"}], [], [{**err, "id": "x"}, {**err, "id": "y"}])
    store.write_batch(2, [], [], [{**err, "id": "y", "attempts": 9}])  # y failed again, later
    state = store.scan()
    assert (state.ok, state.errors, state.next_index) == ({"a"}, {"x", "y"}, 3)
    store.write_batch(3, [{**ok, "id": "x"}], [], [])  # x retried with success
    # a reader between that commit and compaction already sees x resolved, y's latest record only
    assert [(e["id"], e["attempts"]) for e in store.error_view()] == [("y", 9)]
    assert store.scan().errors == {"y"} and store.scan().settled == {"a", "x", "y"}
    finished = store.finish()
    assert (finished.counts["errors"], finished.counts["rejected"]) == (1, 0)
    assert finished.settled == {"a", "x", "y"}
    assert io.list_shards(storage.join(memory_url, "errors")) == [storage.join(memory_url, "errors",
                                                                               "part-00002.parquet")]
    assert store.scan().next_index == 4


def test_regen_reads_its_output_once_at_the_end(tmp_path, fixture_server, monkeypatch):
    """Finalising (views, pruning, the settled check, the manifest counts) is one read per file."""
    extra = [{"id": "bad1", "turns": ["Refuse me [bad-request]"]}, {"id": "t1", "turns": ["Long [truncate]"]}]
    prompts = _prompts(tmp_path, 30, extra)
    out = tmp_path / "responses"
    reads: dict[str, int] = {}
    read_bytes = storage.read_bytes

    def counting(url: str) -> bytes:
        if str(out) in url:
            reads[url] = reads.get(url, 0) + 1
        return read_bytes(url)

    monkeypatch.setattr(storage, "read_bytes", counting)
    counts = regen(_cfg(fixture_server, "regen.batch_rows=8"), prompts, str(out)).counts
    assert (counts["responses"], counts["errors"], counts["rejected"]) == (30, 1, 1)
    batches = [str(p) for d in ("data", "errors", "rejected") for p in (out / d).glob("part-*.parquet")]
    assert len(batches) >= 5 and set(reads) == set(batches)  # nothing else of the output is read
    assert set(reads.values()) == {1}, reads  # each batch file once (none existed at the start)
    _check_complete(prompts, str(out))


def test_partial_batches_are_committed_every_flush_seconds(tmp_path, fixture_server):
    fixture_server.set_faults(delay=0.1)
    prompts = _prompts(tmp_path, 12)
    out = str(tmp_path / "responses")
    cfg = _cfg(fixture_server, "regen.concurrency=2", "regen.batch_rows=1000", "regen.flush_seconds=0.25")
    counts = regen(cfg, prompts, out).counts  # ~0.8 s of requests, far fewer rows than a batch
    assert counts["responses"] == 12 and counts["shards"] >= 2
    _check_complete(prompts, out)


def test_a_run_whose_first_requests_all_fail_alike_stops_early(tmp_path, fixture_server):
    """Issue 29: a dead endpoint took 101 s for 4 prompts (8 retries each at full backoff)."""
    prompts = _prompts(tmp_path, 30)
    out = tmp_path / "responses"
    fixture_server.set_faults(error_500=1.0)
    start = time.monotonic()
    with pytest.raises(StageFailed, match=r"stopped early: the first 8 requests all failed the same way "
                                          r"\(server_error 500: injected server error\)"):
        regen(load_config(None, [f"regen.endpoints=['{fixture_server.url}']", f"regen.model={MODEL}",
                                 "regen.concurrency=2", "regen.retry_base_delay=0.05"]), prompts, str(out))
    assert time.monotonic() - start < 10
    assert fixture_server.stats()["requests"] <= 10  # not 30 prompts × 9 attempts
    assert not out.exists() or not list(out.iterdir())  # nothing answered: no trace, no --force needed
    fixture_server.reset()
    counts = regen(_cfg(fixture_server, "regen.max_tokens=64"), prompts, str(out)).counts
    assert counts["responses"] == 30
