"""Every user mistake ends in one clear line through the installed `dspark` script (issue 15).

Each test names a class of mistake, checks the exit code, that no traceback shows, that the line
names the culprit, and that the corrected command then succeeds without --force.
"""

from __future__ import annotations

import json
import re

import pytest
from fixtures.cli import REPO, assert_user_error, run_dspark
from fixtures.openai_server import start_openai_server

from dspark_cli.config import load_config
from dspark_cli.data.prepare import prepare

MODEL = "fixture-model"


def _prompts_jsonl(path, n: int = 4):
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"q {i}"}]})
                            + "\n" for i in range(n)))
    return path


def test_usage_errors_are_clicks_one_line_and_exit_2(tmp_path):
    """Bad value, unknown flag, flag without value, unknown command: click's message, exit 2."""
    src = str(_prompts_jsonl(tmp_path / "a.jsonl"))
    for args, culprit in [
        (["data", "prepare", "--source", src, "--val-fraction", "abc"], "--val-fraction"),
        (["data", "prepare", "--sourc", src], "--sourc"),
        (["data", "prepare", "--source"], "--source"),
        (["datum", "prepare"], "datum"),
    ]:
        proc = run_dspark(*args, cwd=tmp_path)
        assert_user_error(proc, culprit)
        assert "Usage:" in proc.stderr or "requires an argument" in proc.stderr, proc.stderr
    fixed = run_dspark("data", "prepare", "--source", src, "-o", str(tmp_path / "out"), cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stderr


# ---- data regen against the fixture server ------------------------------------------------------

@pytest.fixture(scope="module")
def server():
    with start_openai_server(model=MODEL) as s:
        yield s


@pytest.fixture(scope="module")
def prompts(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("prompts")
    out = str(root / "prompts")
    prepare(load_config(None, [f"data.source={_prompts_jsonl(root / 'a.jsonl', 6)}"]), out)
    return out


@pytest.fixture(scope="module")
def responses(tmp_path_factory, server, prompts) -> str:
    from dspark_cli.data.regen import regen

    out = str(tmp_path_factory.mktemp("responses") / "responses")
    server.reset()
    regen(load_config(None, [f"regen.endpoints=['{server.url}']", f"regen.model={MODEL}"]), prompts, out)
    return out


def _regen(prompts: str, out, server, *extra: str, env: dict[str, str] | None = None):
    return run_dspark("data", "regen", "-i", prompts, "-o", str(out), "--endpoint", server.url,
                      "--max-retries", "0", "--concurrency", "4", *extra, env=env)


def test_a_failed_probe_claims_nothing(tmp_path, server, prompts):
    """Wrong --model (probe), then the corrected command: no 'made with another config', no --force."""
    out = tmp_path / "responses"
    assert_user_error(_regen(prompts, out, server, "--model", "WRONG"), "WRONG")
    assert not out.exists() or not list(out.iterdir())
    fixed = _regen(prompts, out, server, "--model", MODEL)
    assert fixed.returncode == 0, fixed.stderr
    assert "responses: 6 of 6 prompts" in fixed.stdout


def test_a_run_where_every_request_fails_is_not_done(tmp_path, server, prompts):
    """All requests fail: exit 1, the count and the server's message, no manifest; the rerun redoes them."""
    out = tmp_path / "responses"
    server.reset()
    server.set_faults(error_500=1.0)
    try:
        proc = _regen(prompts, out, server, "--model", MODEL)
    finally:
        server.set_faults()
    line = assert_user_error(proc, "6 prompts", "6 failed", "injected server error", code=1)
    assert "Traceback" not in line and not (out / "manifest.json").exists()
    fixed = _regen(prompts, out, server, "--model", MODEL, "--max-tokens", "64")  # may change config
    assert fixed.returncode == 0, fixed.stderr
    assert "responses: 6 of 6 prompts" in fixed.stdout and (out / "manifest.json").exists()


def test_an_echoed_api_key_is_never_stored_or_printed(tmp_path, server, prompts):
    """A server that echoes the key and the Authorization header in its errors: redacted everywhere."""
    secret = "sk-test-SECRET0123456789abcdef"
    out = tmp_path / "responses"
    server.reset()
    server.set_faults(error_500=1.0, echo_auth=True)
    try:
        proc = _regen(prompts, out, server, "--model", MODEL, env={"OPENAI_API_KEY": secret})
    finally:
        server.set_faults()
    assert_user_error(proc, "[REDACTED]", code=1)
    stored = b"".join(p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert secret not in proc.stdout + proc.stderr and secret.encode() not in stored
    assert b"REDACTED" in stored  # the message was kept, only the key removed
    fixed = _regen(prompts, out, server, "--model", MODEL, env={"OPENAI_API_KEY": secret})
    assert fixed.returncode == 0, fixed.stderr


def test_output_onto_an_input_or_an_existing_file_is_one_line(tmp_path, prompts):
    src = _prompts_jsonl(tmp_path / "a.jsonl")
    before = src.read_bytes()
    assert_user_error(run_dspark("data", "prepare", "--source", str(src), "-o", str(src)), "a.jsonl",
                      "existing file")
    assert src.read_bytes() == before
    assert_user_error(run_dspark("data", "regen", "-i", prompts, "-o", prompts, "--endpoint",
                                 "http://127.0.0.1:9/v1", "--model", MODEL), "output is the input")
    fixed = run_dspark("data", "prepare", "--source", str(src), "-o", str(tmp_path / "p"))
    assert fixed.returncode == 0, fixed.stderr


# ---- eval / calibrate early exits ----------------------------------------------------------------

def _random_export(target, out) -> str:
    import torch
    from fixtures.drafter import drafter_config

    from dspark_cli.model.drafter import DSparkDrafter
    from dspark_cli.model.export import export_drafter
    from dspark_cli.model.frozen import attach_frozen

    torch.manual_seed(0)
    drafter = DSparkDrafter(drafter_config(target, num_draft_layers=1))
    attach_frozen(drafter, str(target))
    export_drafter(drafter, str(out), dtype="float32")
    return str(out)


def test_early_exits_of_eval_and_calibrate_never_abort(tmp_path, tiny_qwen3_target):
    """A bad --drafter with a Parquet dataset: exit 2 every time (it used to abort with 134 now and then
    in Arrow's thread pools' teardown)."""
    src = _prompts_jsonl(tmp_path / "a.jsonl", 4)
    prompts = str(tmp_path / "prompts")
    prepare(load_config(None, [f"data.source={src}", "data.val_fraction=0.5"]), prompts)
    common = ["--target", str(tiny_qwen3_target), "--dataset", prompts]
    for i in range(5):
        cmd = ["eval", "-o", str(tmp_path / "ev")] if i % 2 == 0 else ["calibrate", "-o", str(tmp_path / "c")]
        proc = run_dspark(*cmd, *common, "--drafter", str(tmp_path / "nosuch"))
        assert "terminate called" not in proc.stderr
        assert_user_error(proc, "nosuch")
    drafter = _random_export(tiny_qwen3_target, tmp_path / "export")
    fixed = run_dspark("eval", "-o", str(tmp_path / "ev"), *common, "--drafter", drafter, "--limit", "1",
                       "--max-new-tokens", "4", "--set", "target.dtype=float32", "--no-baseline")
    assert fixed.returncode == 0, fixed.stderr
    assert (tmp_path / "ev" / "report.json").exists()


# ---- offline first ---------------------------------------------------------------------------------

def test_a_hub_id_without_hub_fails_at_once_with_a_local_folder_hint(tmp_path, tiny_qwen3_target, responses):
    """No route to the hub (HF_ENDPOINT on a closed port) or HF_HUB_OFFLINE: one line, no retries."""
    empty_cache = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "0"}
    args = ["cache", "estimate", "--responses", responses, "--target", "Qwen/Qwen3-4B"]
    unreachable = run_dspark(*args, env={**empty_cache, "HF_ENDPOINT": "http://127.0.0.1:9"})
    line = assert_user_error(unreachable, "Qwen/Qwen3-4B", "hub is unreachable")
    assert "Retrying" not in unreachable.stderr and "local folder" in unreachable.stderr, line
    offline = run_dspark(*args, env={**empty_cache, "HF_HUB_OFFLINE": "1"})
    assert_user_error(offline, "Qwen/Qwen3-4B", "HF_HUB_OFFLINE")
    missing = run_dspark("cache", "estimate", "--responses", responses, "--target", str(tmp_path / "a" / "b"))
    assert_user_error(missing, "no such folder")  # not "Repo id must be in the form…"
    assert_user_error(run_dspark("cache", "estimate", "--responses", str(tmp_path / "none"), *args[4:]),
                      "none")  # the local input is checked before the hub is tried
    fixed = run_dspark("cache", "estimate", "--responses", responses, "--target", str(tiny_qwen3_target),
                       "--layers", "1,2")
    assert fixed.returncode == 0, fixed.stderr


def test_a_bad_cpu_bf16_override_is_one_line_and_auto_follows_it(tmp_path, tiny_qwen3_target):
    """target.dtype auto resolves through DSPARK_CPU_BF16 in the installed script; a bad value
    is named, exit 2, and the corrected run writes the dtype it resolved to."""
    args = ["profile", "--target", str(tiny_qwen3_target), "--batch-tokens", "1,2", "--repeats", "1",
            "--context-length", "8", "--device", "cpu"]
    bad = run_dspark(*args, "-o", str(tmp_path / "bad"), env={"DSPARK_CPU_BF16": "yes"})
    assert_user_error(bad, "DSPARK_CPU_BF16", "'yes'")
    ok = run_dspark(*args, "-o", str(tmp_path / "ok"), env={"DSPARK_CPU_BF16": "1"})  # the suite pins 0
    assert ok.returncode == 0, ok.stderr
    assert json.loads((tmp_path / "ok" / "sps.json").read_text())["meta"]["dtype"] == "bfloat16"


# ---- misleading messages -----------------------------------------------------------------------------

def test_messages_name_the_true_cause(tmp_path, tiny_qwen3_target, prompts, responses):
    """Each mistake gets its real cause in one line: the artifact kind, the --set that set a bad value,
    an unknown export architecture, a missing drafter, a refused connection, a non-JSON /models."""
    target = ["--target", str(tiny_qwen3_target), "--layers", "1,2"]
    wrong_kind = run_dspark("cache", "build", "--responses", prompts, "-o", str(tmp_path / "c"), *target)
    assert_user_error(wrong_kind, "--responses", "'data.prepare' artifact")
    assert not (tmp_path / "c").exists()
    assert_user_error(run_dspark("pipeline", "show", "pipelines/qwen3-4b.toml", "--set", "train.lr=abc",
                                 cwd=REPO), "--set train.lr=abc:", "train.lr must be a number")
    assert_user_error(run_dspark("calibrate", *target[:2], "--dataset", prompts, "-o", str(tmp_path / "k"),
                                 "--set", f"pipeline.work_dir='{tmp_path}'"), "drafter", "does not exist")
    refused = run_dspark("data", "regen", "-i", prompts, "-o", str(tmp_path / "r"), "--endpoint",
                         "http://127.0.0.1:9/v1", "--model", MODEL)
    assert_user_error(refused, "connection refused")
    assert "timed out" not in refused.stderr
    fixed = run_dspark("cache", "build", "--responses", responses, "-o", str(tmp_path / "c"), *target,
                       "--set", "target.dtype=float32")
    assert fixed.returncode == 0, fixed.stderr


def test_server_text_is_one_clean_line():
    from dspark_cli.data.regen import model_ids
    from dspark_cli.redact import clean, register_secret

    page = "<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body>" + "x" * 5000 + "</body>"
    assert clean(page) == "HTML page: 502 Bad Gateway"
    register_secret("k3y-abcdefgh")
    assert clean("key k3y-abcdefgh; Authorization: Bearer abc.def-ghi_jkl") == \
        "key [REDACTED]; Authorization: Bearer [REDACTED]"
    assert model_ids("<html>not json</html>") is None and model_ids({"data": [{"id": "m"}]}) == ["m"]


# ---- readable at 80 columns ------------------------------------------------------------------------

def test_help_and_eval_table_are_readable_at_80_columns():
    for command in (["eval", "--help"], ["data", "regen", "--help"], ["calibrate", "--help"]):
        proc = run_dspark(*command, env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"})
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert max(len(line) for line in lines) <= 80, command
        options = [ln.strip("│ ") for ln in lines if ln.strip("│ ").startswith("-")]
        assert len(options) > 10
        for line in options:  # a description gets >= 30 characters per line (rich tables gave ~21)
            parts = re.split(r"\s{2,}", line)
            if len(parts) >= 2:
                assert len(parts[-1]) >= 30 or parts[-1].endswith((".", ")")), line
    regen = run_dspark("data", "regen", "--help", env={"COLUMNS": "80"}).stdout
    for phrase in ("Sampling temperature (default 0.7).", "Nucleus sampling mass (default 0.8).",
                   "Longest answer per turn", "--max-error-share"):
        assert phrase in regen
    assert "--device" in run_dspark("eval", "--help").stdout

    from rich.console import Console

    from dspark_cli.decode.report import render_table

    d = {"name": "gsm8k", "tau": 3.1, "acceptance_rate": 0.61, "drafted": 123456, "verified": 234567,
         "accepted": 99999, "tokens_per_second": {"speculative": 123.4, "target_only": 45.6, "speedup": 2.7},
         "position_acceptance": {"conditional": [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3]}}
    console = Console(width=80, record=True)
    console.print(render_table({"block_size": 7, "temperature": 1.0, "schedule": "fixed", "datasets": [d]}))
    text = console.export_text()
    for header in ("dataset", "accept", "drafted", "verified", "accepted", "spec", "target", "speedup"):
        assert f" {header}" in text, text
    assert "gsm8k: conditional acceptance by position 0.90 0.80" in text


# ---- pipeline preflight ------------------------------------------------------------------------------

def test_pipeline_checks_every_stage_before_the_first(tmp_path, tiny_qwen3_target):
    src = _prompts_jsonl(tmp_path / "a.jsonl")
    toml = tmp_path / "p.toml"
    toml.write_text(f'[pipeline]\nwork_dir = "{tmp_path / "work"}"\n[target]\nmodel = "{tiny_qwen3_target}"\n'
                    f'[data]\nsource = "{src}"\n[regen]\nserve_target = true\n[eval]\ndatasets = []\n')
    proc = run_dspark("pipeline", "run", str(toml))
    assert_user_error(proc, "stage eval", "eval.datasets is empty")
    assert not (tmp_path / "work").exists()  # no stage started
    fixed = run_dspark("pipeline", "run", str(toml), "--stages", "prepare",
                       "--set", f"eval.datasets=['{src}']")
    assert fixed.returncode == 0, fixed.stderr
    assert (tmp_path / "work" / "prompts" / "manifest.json").exists()


def test_qwen3_pipelines_name_existing_eval_sets():
    from dspark_cli.config import load_config

    for toml in sorted((REPO / "pipelines").glob("qwen3-*.toml")):
        datasets = load_config(str(toml), []).eval.datasets
        assert datasets and all((REPO / d).is_file() for d in datasets), toml


# ---- a recipe for your own target ------------------------------------------------------------------

def test_pipeline_new_writes_a_loadable_commented_config(tmp_path, tiny_llama_target):
    out = tmp_path / "my.toml"
    assert_user_error(run_dspark("pipeline", "new", "--target", str(tmp_path / "nope" / "x"), "-o", str(out)),
                      "no such folder")
    made = run_dspark("pipeline", "new", "--target", str(tiny_llama_target), "-o", str(out))
    assert made.returncode == 0, made.stderr
    assert "mask token:" in made.stderr
    cfg = load_config(str(out), [])
    assert cfg.target.layers == "auto" and cfg.eval.datasets and cfg.regen.model == str(tiny_llama_target)
    assert all(line.startswith("#") or "#" in line or not line.strip() or line.startswith("[")
               or line.startswith(("source", "datasets")) for line in out.read_text().splitlines())
    assert_user_error(run_dspark("pipeline", "new", "--target", str(tiny_llama_target), "-o", str(out)),
                      "already exists")


def test_mask_token_rule_spare_row_else_an_unused_special_token(tiny_llama_target):
    from transformers import AutoTokenizer

    from dspark_cli.recipe import choose_mask_token

    tok = AutoTokenizer.from_pretrained(tiny_llama_target)
    assert choose_mask_token(tok, len(tok) + 5).token_id == len(tok)  # a spare embedding row
    tok.add_special_tokens({"additional_special_tokens": ["<|reserved_special_token_0|>", "<|other|>"]})
    choice = choose_mask_token(tok, len(tok))  # every row is a token: a reserved one chat never uses
    assert tok.convert_ids_to_tokens(choice.token_id) == "<|reserved_special_token_0|>"
    assert choice.token_id not in (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)


def test_a_wrong_path_fails_before_torch_loads(tmp_path):
    """eval, calibrate and cache estimate check their inputs before importing torch, Transformers
    or matplotlib (~3 s on 2 cores): a typo is answered in well under a second."""
    missing = tmp_path / "missing"
    for args, culprit in [
        (["eval", "--drafter", str(missing), "--target", str(missing), "--dataset", f"{missing}.jsonl"],
         "missing.jsonl"),
        (["calibrate", "--drafter", str(missing), "--target", str(missing)], str(missing)),
        (["cache", "estimate", "--responses", str(missing), "--target", str(missing)], str(missing)),
    ]:
        proc = run_dspark(*args, cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
        assert_user_error(proc, culprit)
        imported = imported_modules(proc)
        assert "dspark_cli.cli" in imported, proc.stderr[-500:]  # the profile did record the imports
        assert not imported & {"torch", "transformers", "matplotlib"}, args


def test_a_bad_flag_of_train_or_profile_fails_before_torch_loads(tmp_path):
    """train and profile validate their flags and config before importing the trainer or the
    decoder (torch, ~2 s on 2 cores)."""
    for args, culprit in [(["train", "--epochs", "-3"], "--epochs"),
                          (["profile", "--repeats", "0"], "--repeats")]:
        proc = run_dspark(*args, cwd=tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
        assert_user_error(proc, culprit)
        imported = imported_modules(proc)
        assert "dspark_cli.cli" in imported, proc.stderr[-500:]
        assert not imported & {"torch", "transformers"}, args


def imported_modules(proc) -> set[str]:
    """Modules a `PYTHONPROFILEIMPORTTIME=1` run imported (its stderr's 'import time:' lines)."""
    return {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines()
            if line.startswith("import time:")}


@pytest.mark.parametrize(("key", "bad"), [("train.compile_vocab", "sometimes"),
                                          ("target.compile_draft", "maybe")])
def test_a_bad_compile_switch_is_one_line_through_the_entry_point(key, bad):
    """The Inductor switches take true, false or "auto"; anything else is named in one line, and
    the corrected value then runs."""
    config = "pipelines/smollm2-135m.toml"
    proc = run_dspark("pipeline", "show", config, "--set", f"{key}={bad}", cwd=REPO)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip() == (f'error: --set {key}={bad}: {key} must be true, false or "auto", '
                                   f"got '{bad}'.")
    assert run_dspark("pipeline", "show", config, "--set", f"{key}=false", cwd=REPO).returncode == 0
