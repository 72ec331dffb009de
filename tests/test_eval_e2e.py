"""End to end: the tiny Qwen3 target, a briefly trained drafter, real speculative decoding."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from fixtures.eval_drafter import drafter_settings, train_drafter
from fixtures.tiny_models import mask_token_id

from dspark_cli import manifest, storage
from dspark_cli.config import load_config
from dspark_cli.decode.prompts import Conversation, load_conversations
from dspark_cli.decode.scheduler import Scheduler
from dspark_cli.decode.specdec import DecodeStats, SpeculativeDecoder, paired_decode, target_only
from dspark_cli.decode.sps import SpsTable
from dspark_cli.decode.stages import run_calibrate, run_eval
from dspark_cli.errors import DsparkError
from dspark_cli.model.export import load_drafter
from dspark_cli.schemas import validate
from dspark_cli.target.model import load_target

CONVS = [Conversation("a", ["What is 12 plus 30?", "And plus 2?"]),
         Conversation("b", ["Write a short poem about the sea."], system="Be brief."),
         Conversation("c", ["Hello!"])]


@pytest.fixture(scope="module")
def trained(tiny_qwen3_target, tmp_path_factory) -> tuple[Path, str]:
    out = tmp_path_factory.mktemp("eval-train")
    return out, train_drafter(tiny_qwen3_target, mask_token_id(tiny_qwen3_target), out, steps=40)


@pytest.fixture(scope="module")
def models(tiny_qwen3_target, trained):
    model, tokenizer = load_target(str(tiny_qwen3_target), dtype="float32", device="cpu")
    return model, tokenizer, load_drafter(trained[1], target=str(tiny_qwen3_target))


def _jsonl(path: Path, rows: list[list[str]]) -> str:
    path.write_text("".join(json.dumps({"turns": t}) + "\n" for t in rows))
    return str(path)


def _cfg(target: Path, out: Path, *sets: str):
    return load_config(None, [*drafter_settings(target, mask_token_id(target), str(out)), *sets])


def test_target_only_baseline_computes_logits_for_sampled_rows_only(models):
    """The tokens/s baseline must not pay for vocabulary-wide logits it never samples: its prefill
    keeps the prompt's last row only, as the speculative prefill does (features, then one row)."""
    model, tokenizer, _drafter = models
    rows: list[int] = []
    hook = model.get_output_embeddings().register_forward_hook(
        lambda _m, _i, out: rows.append(out.reshape(-1, out.shape[-1]).shape[0]))
    try:
        stats = target_only(model, tokenizer, CONVS[:1], temperature=0.0, max_new_tokens=4, thinking=False)
    finally:
        hook.remove()
    assert stats.new_tokens > 0 and rows and set(rows) == {1}


@pytest.mark.parametrize(("schedule", "concurrency", "top_k"),
                         [("fixed", 1, 64), ("fixed", 3, 0), ("threshold", 2, 64), ("algorithm1", 3, 64),
                          ("async", 3, 8)])
def test_greedy_speculative_output_equals_target_only(models, schedule, concurrency, top_k):
    """At temperature 0 speculative decoding must reproduce the target's own greedy text exactly,
    whatever the schedule, the number of requests batched per round and the drafter's top-k."""
    model, tokenizer, drafter = models
    base = target_only(model, tokenizer, CONVS, temperature=0.0, max_new_tokens=24, thinking=False)
    sps = SpsTable([1, 4, 8, 16], [100.0, 95.0, 60.0, 30.0])
    decoder = SpeculativeDecoder(model, tokenizer, drafter, Scheduler(schedule, drafter.block_size, sps),
                                 temperature=0.0, max_new_tokens=24, draft_top_k=top_k)
    spec = decoder.run(CONVS, concurrency)
    assert spec.answers == base.answers
    assert spec.new_tokens == base.new_tokens and spec.turns == 4
    assert sum(r.accepted for r in spec.rounds) > 0  # the drafter did contribute tokens
    # Every round emits accepted + 1 tokens: the rounds account for every generated token.
    assert sum(r.accepted + 1 for r in spec.rounds) + spec.turns >= spec.new_tokens
    # Rounds really were batched: as many requests per round as were in flight.
    assert max(b.requests for b in spec.batches) == min(concurrency, len(CONVS))


def test_trained_drafter_is_accepted_more_than_untrained(models, tiny_qwen3_target):
    from dspark_cli.model.drafter import DSparkDrafter
    from dspark_cli.model.frozen import attach_frozen

    model, tokenizer, trained = models
    torch.manual_seed(123)
    untrained = DSparkDrafter(trained.config)
    attach_frozen(untrained, str(tiny_qwen3_target))
    untrained.eval()
    taus = []
    for drafter in (trained, untrained):
        stats = SpeculativeDecoder(model, tokenizer, drafter, Scheduler("fixed", 4), temperature=0.0,
                                   max_new_tokens=32).run(CONVS)
        taus.append(sum(r.accepted + 1 for r in stats.rounds) / len(stats.rounds))
    assert taus[0] > taus[1], taus


def _cli(*args: str) -> int:
    """Run the real `dspark` entry point in-process; returns its exit code."""
    from dspark_cli.cli import main

    try:
        main(list(args))
    except SystemExit as e:
        return int(e.code or 0)
    return 0


def test_eval_cli_writes_report_and_skips_when_done(trained, tiny_qwen3_target, tmp_path, capsys):
    out_dir, train_url = trained
    data = _jsonl(tmp_path / "mt.jsonl", [["Hello!", "More please."], ["What is 12 plus 30?"],
                                          ["Write a poem."]])
    output = str(tmp_path / "eval")
    args = ["eval", "--target", str(tiny_qwen3_target), "--drafter", train_url, "--dataset", data,
            "--limit", "2", "--max-new-tokens", "16", "--output", output,
            "--set", "target.dtype='float32'", "--set", "target.device='cpu'"]
    assert _cli(*args) == 0
    report = storage.read_json(f"{output}/report.json")
    validate(report, "eval_report")
    (d,) = report["datasets"]
    assert (d["name"], d["conversations"], d["turns"]) == ("mt", 2, 3)
    assert d["tau"] == pytest.approx((d["accepted"] + d["rounds"]) / d["rounds"]) and d["tau"] >= 1
    assert d["drafted"] == 4 * d["rounds"] and d["accepted"] <= d["verified"] <= d["drafted"]
    pa = d["position_acceptance"]
    # A round with no room left (one token short of --max-new-tokens) verifies nothing: slot 0 is
    # reached in every other round.
    assert len(pa["conditional"]) == 4 and 0 < pa["reached"][0] <= d["rounds"]
    assert all(a <= n for a, n in zip(pa["accepted"], pa["reached"], strict=True))
    assert d["tokens_per_second"]["speculative"] > 0 and d["tokens_per_second"]["target_only"] > 0
    assert [s["threshold"] for s in d["threshold_sweep"]][:2] == [0.05, 0.1]
    conv = d["per_conversation"]
    assert len(conv["ids"]) == 2 and sum(conv["rounds"]) == d["rounds"]
    assert sum(conv["accepted"]) == d["accepted"]
    assert storage.read_bytes(f"{output}/acceptance.png")[:4] == b"\x89PNG"
    assert storage.read_bytes(f"{output}/threshold_sweep.png")[:4] == b"\x89PNG"
    assert manifest.read_manifest(output)["counts"]["datasets"] == 1
    printed = "".join(capsys.readouterr().out.split())  # a long tmp path wraps the line
    assert "report.json" in printed and "mt:aroundcosts" in printed and "targetsteps" in printed
    assert _cli(*args) == 0 and "nothing to do" in capsys.readouterr().err
    assert _cli(*args, "--temperature", "0") == 2
    err = capsys.readouterr().err
    assert "eval.temperature" in err and "--force" in err


def test_calibrate_then_eval_with_calibration_sps_and_scheduler(trained, tiny_qwen3_target, tmp_path,
                                                                 memory_url):
    out_dir, train_url = trained
    held_out = _jsonl(tmp_path / "held.jsonl", [["Explain step by step."], ["The quick brown fox"],
                                                ["import numpy as np"], ["Hello! How are you?"]])
    cfg = _cfg(tiny_qwen3_target, out_dir, "calibrate.num_prompts=4", "calibrate.max_new_tokens=24",
               "calibrate.t_steps=40")
    cal_url = memory_url + "/calibration"
    calibrated = run_calibrate(cfg, str(tiny_qwen3_target), train_url, held_out, cal_url)
    result = storage.read_json(cal_url + "/calibration.json")
    validate(result, "calibration")
    assert calibrated.state == "fresh" and calibrated.summary == {
        "temperatures": result["temperatures"], "ece_before": result["pooled_ece_before"],
        "ece_after": result["pooled_ece_after"], "num_samples": result["num_samples"],
        "fitted": result["fitted"], "ece_source": "cross_fit", "calibration": cal_url + "/calibration.json"}
    assert len(result["temperatures"]) == 4
    assert all(type(x) is float for k in ("temperatures", "ece_before", "ece_after") for x in result[k])
    assert len(result["ece_before"]) == len(result["ece_after"]) == 4
    assert result["ece_source"] == "cross_fit" and result["cross_fit"]["conversations"] == [2, 2]
    assert result["in_sample"]["pooled_ece_after"] <= result["in_sample"]["pooled_ece_before"] + 1e-9
    assert len(result["fitted"]) == 4
    assert storage.read_bytes(cal_url + "/reliability.png")[:4] == b"\x89PNG"
    assert storage.read_json(cal_url + "/calibration.json")["num_samples"] == result["num_samples"]

    sps_url = memory_url + "/sps.json"
    storage.write_json(sps_url, {"schema_version": 1, "batch_tokens": [1, 4, 8, 16],
                                 "steps_per_second": [100.0, 95.0, 60.0, 30.0]})
    data = _jsonl(tmp_path / "g.jsonl", [["What is 12 plus 30?"], ["Write a poem."], ["Hello!"]])
    cfg = _cfg(tiny_qwen3_target, out_dir, f"eval.datasets=['{data}']", "eval.schedule='algorithm1'",
               "eval.concurrency=2", "eval.concurrency_sweep=[1, 3]", f"eval.sps='{sps_url}'",
               f"eval.calibration='{cal_url}/calibration.json'", "eval.max_new_tokens=16",
               "eval.baseline=false")
    report = run_eval(cfg, str(tiny_qwen3_target), train_url, memory_url + "/eval").summary
    assert report == storage.read_json(memory_url + "/eval/report.json")
    sched = report["datasets"][0]["scheduler"]
    assert [s["concurrency"] for s in sched] == [2, 1, 3]
    assert all(s["policy"] == "algorithm1" and s["verified_per_round"] >= 1 for s in sched)
    assert all(0 <= s["budget_per_request"] <= 4 for s in sched)
    assert report["datasets"][0]["tokens_per_second"]["target_only"] is None
    with pytest.raises(DsparkError, match="temperatures"):
        storage.write_json(memory_url + "/bad.json", {**result, "temperatures": [1.0, 1.0]})
        cfg = _cfg(tiny_qwen3_target, out_dir, f"eval.datasets=['{data}']",
                   f"eval.calibration='{memory_url}/bad.json'")
        run_eval(cfg, str(tiny_qwen3_target), train_url, memory_url + "/eval-bad")


def test_calibrate_concurrency_batches_the_same_rounds(models, trained, tiny_qwen3_target, memory_url):
    """calibrate.concurrency only batches: greedily, every conversation's rounds (acceptances and
    confidences) are those decoded one at a time; at 1 the key stays out of the stage config, so a
    run made before it existed still resumes and is still reused."""
    from dspark_cli.decode.stages import calibration_rounds

    model, tokenizer, drafter = models
    out_dir, train_url = trained

    def per_conversation(concurrency: int) -> dict[str, tuple[list[int], list[list[float]]]]:
        cfg = _cfg(tiny_qwen3_target, out_dir, "calibrate.temperature=0", "calibrate.max_new_tokens=20",
                   f"calibrate.concurrency={concurrency}")
        rows: list[int] = []
        embed = model.get_input_embeddings()
        hook = embed.register_forward_hook(lambda _m, ids, _o: rows.append(len(ids[0])))
        try:
            rec = calibration_rounds(cfg, model, tokenizer, drafter, CONVS)
        finally:
            hook.remove()
        assert max(rows) == concurrency  # the target's rounds really were batched
        return {g: (rec.accepted[rec.groups == g].tolist(), rec.confidences[rec.groups == g].tolist())
                for g in sorted(set(rec.groups))}

    alone, batched = per_conversation(1), per_conversation(3)
    assert sorted(alone) == sorted(batched) == ["a", "b", "c"]
    for conv in alone:
        assert batched[conv][0] == alone[conv][0]
        assert torch.allclose(torch.tensor(batched[conv][1]), torch.tensor(alone[conv][1]), atol=1e-4)
    assert sum(sum(acc) for acc, _ in alone.values()) > 0

    for concurrency in (1, 2):
        cfg = _cfg(tiny_qwen3_target, out_dir, "calibrate.num_prompts=2", "calibrate.max_new_tokens=8",
                   "calibrate.t_steps=10", "calibrate.min_prefixes=1", f"calibrate.concurrency={concurrency}")
        url = f"{memory_url}/cal-r{concurrency}"
        run_calibrate(cfg, str(tiny_qwen3_target), train_url, _held_out(out_dir), url)
        recorded = manifest.read_manifest(url)["config"]["calibrate"]
        assert recorded.get("concurrency") == (None if concurrency == 1 else 2)


def _held_out(folder: Path) -> str:
    return _jsonl(folder / "held-2.jsonl", [["Explain step by step."], ["The quick brown fox"]])


def test_eval_killed_midway_resumes_from_committed_datasets(trained, tiny_qwen3_target, tmp_path):
    out_dir, train_url = trained
    first = _jsonl(tmp_path / "first.jsonl", [["Hello!"]])
    second = _jsonl(tmp_path / "second.jsonl", [[f"Write poem number {i}."] for i in range(6)])
    output = tmp_path / "eval"
    args = [sys.executable, "-m", "dspark_cli.cli", "eval", "--target", str(tiny_qwen3_target),
            "--drafter", train_url, "--dataset", first, "--dataset", second, "--max-new-tokens", "16",
            "--output", str(output), "--set", "target.dtype='float32'", "--set", "target.device='cpu'"]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    part = output / "parts" / "000-first.json"
    deadline = time.time() + 240
    while not part.exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    assert part.exists() and not (output / "report.json").exists()
    before = part.read_text()
    resumed = subprocess.run(args, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr
    assert "already decoded" in resumed.stderr and part.read_text() == before
    names = [d["name"] for d in storage.read_json(str(output / "report.json"))["datasets"]]
    assert names == ["first", "second"]


def test_prompts_jsonl_and_artifact(tmp_path, memory_url):
    from dspark_cli.data.io import PROMPT_SCHEMA, write_table

    good = _jsonl(tmp_path / "ok.jsonl", [["a", "b"], ["c"]])
    convs = load_conversations(good, limit=1)
    assert [(c.turns, c.system) for c in convs] == [(["a", "b"], None)]
    (tmp_path / "bad.jsonl").write_text('{"turns": ["x"]}\n{"prompt": "y"}\n')
    with pytest.raises(DsparkError, match=r"bad\.jsonl:2"):
        load_conversations(str(tmp_path / "bad.jsonl"))
    rows = [{"id": f"p{i}", "source": "s", "split": "validation" if i % 2 else "train",
             "messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": f"q{i}"}],
             "original_assistant": ["x"]} for i in range(4)]
    write_table(memory_url + "/prompts/data/part-00000.parquet", rows, PROMPT_SCHEMA)
    val = load_conversations(memory_url + "/prompts", split="validation")
    assert [(c.id, c.turns, c.system) for c in val] == [("p1", ["q1"], "sys"), ("p3", ["q3"], "sys")]
    with pytest.raises(DsparkError, match="neither"):
        load_conversations(memory_url + "/nothing")


def test_profile_cli_writes_sps_table(tiny_qwen3_target, tmp_path, capsys):
    from dspark_cli.decode.sps import SpsTable

    output = tmp_path / "profile"
    assert _cli("profile", "--target", str(tiny_qwen3_target), "--batch-tokens", "1,4,16", "--repeats", "2",
                "--context-length", "16", "--dtype", "float32", "--device", "cpu", "-o", str(output)) == 0
    table = SpsTable.load(str(output / "sps.json"))
    assert table.batch_tokens == [1, 4, 16] and all(s > 0 for s in table.steps_per_second)
    assert table.meta["device"] == "cpu" and (output / "sps.png").read_bytes()[:4] == b"\x89PNG"
    assert "steps/s" in capsys.readouterr().out
    assert _cli("profile", "--target", str(tiny_qwen3_target), "--batch-tokens", "1,x",
                "-o", str(tmp_path / "p2")) == 2
    assert "--batch-tokens" in capsys.readouterr().err


def test_dflash_baseline_drafter_decodes_losslessly_and_calibrate_skips(models, tiny_qwen3_target, tmp_path):
    """fill_in convention, no Markov head, no confidence head: fixed schedule only, nothing to calibrate."""
    from dspark_cli.model.config import DrafterConfig
    from dspark_cli.model.drafter import DSparkDrafter
    from dspark_cli.model.export import export_drafter
    from dspark_cli.model.frozen import attach_frozen

    model, tokenizer, trained = models
    settings = {"num_draft_layers": 1, "block_size": 3, "block_convention": "fill_in",
                "markov_head_type": "none", "enable_confidence_head": False}
    config = DrafterConfig.from_dict({**trained.config.to_dict(), **settings})
    torch.manual_seed(0)
    dflash = DSparkDrafter(config)
    attach_frozen(dflash, str(tiny_qwen3_target))
    export = str(tmp_path / "dflash-export")
    export_drafter(dflash, export, dtype="float32")
    drafter = load_drafter(export, target=str(tiny_qwen3_target))
    base = target_only(model, tokenizer, CONVS[:2], temperature=0.0, max_new_tokens=12, thinking=False)
    spec = SpeculativeDecoder(model, tokenizer, drafter, Scheduler("fixed", 3), temperature=0.0,
                              max_new_tokens=12).run(CONVS[:2])
    assert spec.answers == base.answers and all(r.confidences is None for r in spec.rounds)
    with pytest.raises(DsparkError, match="confidence head"):
        SpeculativeDecoder(model, tokenizer, drafter, Scheduler("algorithm1", 3), temperature=0.0,
                           max_new_tokens=12).run(CONVS[:1])
    held = _jsonl(tmp_path / "held.jsonl", [["Hello!"]])
    cfg = _cfg(tiny_qwen3_target, tmp_path, "calibrate.num_prompts=1")
    skipped = run_calibrate(cfg, str(tiny_qwen3_target), export, held, str(tmp_path / "cal"))
    assert skipped.state == "skipped" and skipped.summary == {"skipped": "no confidence head"}
    again = run_calibrate(cfg, str(tiny_qwen3_target), export, held, str(tmp_path / "cal"))
    assert again.done and again.summary == {"skipped": "no confidence head"}
    assert manifest.read_manifest(str(tmp_path / "cal"))["extra"]["skipped"] == "no confidence head"


def test_bad_inputs_fail_in_one_line_before_claiming_the_output(trained, tiny_qwen3_target, tmp_path):
    out_dir, train_url = trained
    output = tmp_path / "eval"
    cfg = _cfg(tiny_qwen3_target, out_dir, f"eval.datasets=['{tmp_path}/missing.jsonl']")
    with pytest.raises(DsparkError, match="missing.jsonl: file not found"):
        run_eval(cfg, str(tiny_qwen3_target), train_url, str(output))
    data = _jsonl(tmp_path / "ok.jsonl", [["Hello!"]])
    cfg = _cfg(tiny_qwen3_target, out_dir, f"eval.datasets=['{data}']", f"eval.sps='{tmp_path}/no-sps.json'")
    with pytest.raises(DsparkError, match="no-sps.json"):
        run_eval(cfg, str(tiny_qwen3_target), train_url, str(output))
    with pytest.raises(DsparkError, match="no target"):
        run_eval(_cfg(tiny_qwen3_target, out_dir, f"eval.datasets=['{data}']"), "", train_url, str(output))
    assert not output.exists()  # nothing claimed: fixing the typo needs no --force


def test_scheduler_table_only_when_there_is_a_schedule_to_show():
    from rich.console import Console

    from dspark_cli.decode.report import render_scheduler_table

    sched = {"policy": "algorithm1", "concurrency": 2, "rounds": 5, "verified_per_round": 3.0,
             "tau_per_request": 2.0, "theta": 4.0, "budget_per_request": 1.0}
    report = {"schedule": "algorithm1", "sps": "sps.json", "concurrency": 2,
              "datasets": [{"name": "g", "scheduler": [sched]}]}
    console = Console(width=160, record=True)
    console.print(render_scheduler_table(report))
    text = console.export_text()
    assert "algorithm1" in text and "budget/request" in text and "4.00" in text
    assert render_scheduler_table({**report, "schedule": "fixed", "concurrency": 1}) is None


def test_incremental_features_and_cache_match_a_full_forward_after_rejections(models):
    """At T=1 (rejections, corrections, bonus tokens) the drafter's context stays exactly what a
    fresh pass over the accepted sequence's features gives, and the KV cache holds every position
    before the anchor."""
    from dspark_cli.decode.specdec import Stopwatch
    from dspark_cli.target.capture import capture_layers

    model, tokenizer, drafter = models
    decoder = SpeculativeDecoder(model, tokenizer, drafter, Scheduler("fixed", drafter.block_size),
                                 temperature=1.0, max_new_tokens=40, seed=3)
    decoder._start()
    decoder._join(CONVS[0], 0, [], [])
    stats = DecodeStats(gamma=drafter.block_size)
    (req,) = decoder._requests
    while not decoder._finished(req):
        decoder._round(stats, Stopwatch(torch.device("cpu"), stats.phases))
    assert any(r.accepted < r.verified for r in stats.rounds)  # rejections happened
    n = len(req.ids) - 1
    assert decoder._batch.cache.get_seq_length() == n == decoder._context.lengths[0]
    full, _final = capture_layers(model, req.ids[:-1], drafter.config.target_layer_ids)
    fresh = drafter.new_context()
    fresh.add_row()
    drafter.extend_context(fresh, [full.to(torch.bfloat16)])
    for mine, theirs in zip(decoder._context.layer_kv(), fresh.layer_kv(), strict=True):
        torch.testing.assert_close(mine[0], theirs[0], atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(mine[1], theirs[1], atol=3e-2, rtol=3e-2)


def test_paired_decode_alternates_which_loop_goes_first_and_merges_every_field():
    """Both loops see the same minutes: conversation i runs speculative first when i is even,
    target-only first when odd, and each side's parts sum to one DecodeStats."""
    calls: list[tuple[str, str]] = []

    def loop(name: str, seconds: float):
        def decode(convs: list[Conversation]) -> DecodeStats:
            (conv,) = convs
            calls.append((name, conv.id))
            stats = DecodeStats(gamma=3, new_tokens=len(conv.id) * 10, seconds=seconds, turns=1)
            stats.answers[conv.id] = [name]
            stats.phases["verify"] = seconds / 2
            return stats
        return decode

    spec, base = paired_decode(loop("spec", 1.0), loop("base", 2.0), CONVS)
    assert calls == [("spec", "a"), ("base", "a"), ("base", "b"), ("spec", "b"), ("spec", "c"), ("base", "c")]
    assert (spec.new_tokens, spec.seconds, spec.turns, spec.phases) == (30, 3.0, 3, {"verify": 1.5})
    assert (base.seconds, base.answers) == (6.0, {"a": ["base"], "b": ["base"], "c": ["base"]})


def test_eval_baseline_at_r1_is_timed_paired_and_greedy_token_counts_match(trained, tiny_qwen3_target,
                                                                          tmp_path):
    """The eval's own speed-up at R = 1: paired timing recorded, and at T = 0 the speculative
    loop emits as many tokens as the target-only one (the same greedy text, tested above)."""
    out_dir, train_url = trained
    data = _jsonl(tmp_path / "p.jsonl", [["What is 12 plus 30?"], ["Write a poem."], ["Hello!"]])
    cfg = _cfg(tiny_qwen3_target, out_dir, f"eval.datasets=['{data}']", "eval.max_new_tokens=12",
               "eval.temperature=0.0", "eval.baseline=true")
    report = run_eval(cfg, str(tiny_qwen3_target), train_url, str(tmp_path / "eval")).summary
    speed = report["datasets"][0]["tokens_per_second"]
    assert speed["timing"] == "paired"
    assert speed["speedup"] > 0 and speed["target_only_tokens"] == report["datasets"][0]["new_tokens"]
    # The round's cost in target steps explains the measured speed-up, and the phases cover it.
    cost = report["datasets"][0]["round_cost"]
    assert cost["tokens_per_round"] / cost["cost_in_target_steps"] == pytest.approx(speed["speedup"])
    assert cost["parts"]["draft"] > 0 and cost["parts"]["verify"] > 0
    assert abs(cost["parts"]["other"]) < 0.05 * cost["cost_in_target_steps"]
