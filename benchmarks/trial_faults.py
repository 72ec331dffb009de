"""The mistakes-and-faults trial (issue 29): a user's typical mistakes and the environment's faults,
run through the installed `dspark` script, every command, and judged as a user would.

    python -m benchmarks.trial_faults                 # prints the table; --json FILE keeps it
    python -m benchmarks.trial_faults --only export   # the cases whose name starts with "export"

For each case: no traceback; exit 2 for a mistake (130 for Ctrl-C, 0 where the input is fine);
every file the user had beforehand is still there, byte for byte; where a corrected command is
cheap, it is run and must succeed (nothing left behind blocks it). Then the message is judged:
"clear" when its error/hint lines name the culprit (file, flag or key) and what to do, "unclear"
when they do not, "bad" when a check above fails. The real parts are the tests' own: a tiny real
Qwen3 target, the fixture OpenAI server, a real cache, a real 3-step drafter. The set-up that
builds a cache and trains takes /tmp/dspark-heavy.lock (shared machines); the cases are light.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

LOCK = "/tmp/dspark-heavy.lock"
#: What the set-up builds, kept by --reuse; everything else in the folder is made afresh.
BUILT = {"target", "prompts", "responses", "cache", "train"}
TINY = ["model.num_draft_layers=1", "model.block_size=3", "model.markov_rank=8", "train.num_anchors=6",
        "train.global_batch=2", "train.save_every=2", "train.log_every=1", "target.device=cpu"]


def dspark_script() -> str:
    beside = Path(sys.executable).parent / "dspark"
    return str(beside) if beside.exists() else shutil.which("dspark") or "dspark"


def env() -> dict[str, str]:
    e = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200", "HF_HUB_OFFLINE": "1",
         "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    e.pop("DSPARK_DEBUG", None)
    e.pop("TRIAL_UNSET_KEY", None)
    return e


def run(argv: list[str], cwd: Path, timeout: float = 300) -> tuple[int, str, str, float]:
    started = time.time()
    proc = subprocess.run([dspark_script(), *argv], cwd=cwd, env=env(), capture_output=True, text=True,
                          timeout=timeout)
    return proc.returncode, proc.stdout, proc.stderr, time.time() - started


#: --no-lock: on a machine of one's own (or for the tiny trainings alone) the lock is not taken.
USE_LOCK = True


@contextmanager
def heavy():
    """The shared machine's one-heavy-job-at-a-time lock, for the set-up that builds and trains."""
    if not USE_LOCK:
        yield
        return
    with open(LOCK, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def snapshot(paths: list[Path]) -> dict[str, str]:
    """Every file under the user's paths with its content hash: what must survive every case."""
    found = {}
    for root in paths:
        for p in [root] if root.is_file() else sorted(root.rglob("*")):
            if p.is_file():
                found[str(p)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


@dataclass
class Case:
    name: str
    argv: list[str]
    #: What the message must name (file, flag or key) to count as clear.
    culprits: list[str] = field(default_factory=list)
    code: int = 2
    #: The corrected command, run after the case: must exit 0 (and say `rerun_says`, if given).
    rerun: list[str] | None = None
    rerun_says: str = ""
    #: Runs before the case (e.g. damages a file); returns nothing.
    before: Callable[[], None] | None = None
    #: Replaces `run` (Ctrl-C): returns (code, stdout, stderr, seconds).
    runner: Callable[[], tuple[int, str, str, float]] | None = None
    #: Text that must not appear anywhere in the output (a password).
    secret: str = ""
    #: Longest acceptable time, seconds (a failing endpoint must not take minutes).
    max_seconds: float = 120.0
    #: Trains for real: the case and its rerun take the heavy-job lock, and run last.
    heavy: bool = False


@dataclass
class Result:
    name: str
    command: str
    code: int
    seconds: float
    message: str
    verdict: str
    why: str = ""


def message_of(stderr: str, stdout: str) -> str:
    """The lines a user reads first: `error:`, `hint:`, click's `Error:`, `interrupted`."""
    keep = [ln.strip() for ln in (stderr + "\n" + stdout).splitlines()
            if re.match(r"\s*(error|hint|warning|interrupted|Error|│ )", ln, re.I)]
    if not keep:
        keep = [ln.strip() for ln in stderr.splitlines() if ln.strip()][-2:]
    return " / ".join(dict.fromkeys(keep))[:400]


def judge(case: Case, root: Path, user: list[Path], before_files: dict[str, str]) -> Result:
    argv = [a.replace("{r}", str(root)) for a in case.argv]
    if case.before:
        case.before()
    lock = heavy() if case.heavy else nullcontext()
    with lock:
        code, out, err, seconds = case.runner() if case.runner else run(argv, root)
    text = out + err
    msg = message_of(err, out)
    problems = []
    if "Traceback" in text:
        problems.append("traceback")
    if code != case.code:
        problems.append(f"exit {code}, expected {case.code}")
    after = snapshot(user)
    lost = [p for p, h in before_files.items() if after.get(p) != h]
    if lost:
        problems.append(f"user file changed or lost: {lost[:3]}")
    if case.secret and case.secret in text:
        problems.append("secret printed")
    if seconds > case.max_seconds:
        problems.append(f"took {seconds:.0f}s")
    if case.rerun is not None and not problems:
        with heavy() if case.heavy else nullcontext():
            rc, rout, rerr, _ = run([a.replace("{r}", str(root)) for a in case.rerun], root)
        if rc != 0:
            problems.append(f"corrected rerun exit {rc}: {message_of(rerr, rout)[:160]}")
        elif case.rerun_says and case.rerun_says not in rout + rerr:
            problems.append(f"corrected rerun did not say {case.rerun_says!r}")
    command = "dspark " + " ".join(a.replace(str(root), "$R") for a in argv)
    msg = msg.replace(str(root), "$R")
    if problems:
        return Result(case.name, command, code, seconds, msg, "bad", "; ".join(problems))
    if case.code == 0:
        return Result(case.name, command, code, seconds, msg, "clear", "succeeds")
    said = msg.lower()
    missing = [c for c in case.culprits if c.replace("{r}", "$R").lower() not in said]
    if missing:
        return Result(case.name, command, code, seconds, msg, "unclear", f"does not name {missing}")
    return Result(case.name, command, code, seconds, msg, "clear")


# --------------------------------------------------------------------------- set-up


def _row(i: int) -> str:
    return json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"question {i}"}]}) + "\n"


def setup(root: Path) -> dict[str, Path]:
    """The user's own files, damaged inputs, and real small artifacts (prompts, cache, drafter)."""
    from fixtures.cache_responses import response_rows, write_responses
    from fixtures.tiny_models import build_tiny_target, mask_token_id

    p: dict[str, Path] = {}
    built = (root / "train" / "manifest.json").exists()  # --reuse: keep the built artifacts only
    for old in root.iterdir() if built else []:
        if old.name not in BUILT:
            shutil.rmtree(old) if old.is_dir() else old.unlink()
    # The user's own things: must survive every case unchanged.
    (root / "notes.txt").write_text("the user's own notes\n")
    mine = root / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("the user's own folder\n")
    (mine / "sub").mkdir()
    (mine / "sub" / "data.bin").write_bytes(os.urandom(64))
    p["user"] = [root / "notes.txt", mine]

    (root / "a_folder").mkdir()
    (root / "good.jsonl").write_text("".join(_row(i) for i in range(12)))
    (root / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + "".join(_row(i) for i in range(5)).encode())
    (root / "notgzip.jsonl.gz").write_bytes(b"plain text, not gzip\n")
    (root / "binary.bin").write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\x01")
    (root / "latin1.toml").write_bytes(b"[train]\nlr = 3e-4  # caf\xe9\n")
    (root / "syntax.toml").write_text("[train]\nlr = = 3\n")
    (root / "typo_key.toml").write_text("[train]\nlearning_rate = 3e-4\n")
    (root / "typo_section.toml").write_text("[trian]\nlr = 3e-4\n")
    (root / "fake.gguf").write_bytes(b"GGUF" + b"\0" * 60)
    (root / "eval.jsonl").write_text('{"turns": ["What is 12 plus 30?"]}\n')
    (root / "bad_eval.jsonl").write_text('{"turns": ["What is 12 plus 30?"]}\nnot json at all\n')

    target = root / "target"
    if not built:
        print("set-up: tiny target, prompts, responses, cache, a 3-step drafter …", flush=True)
        build_tiny_target(target, style="qwen3", num_layers=6)
    mask = mask_token_id(target)
    p["mask"] = mask
    from transformers import AutoTokenizer

    p["eos"] = AutoTokenizer.from_pretrained(target).eos_token_id
    cfg = root / "trial.toml"
    cfg.write_text(f'[pipeline]\nwork_dir = "work"\n[data]\nsource = "good.jsonl"\nval_fraction = 0.25\n'
                   f'[target]\nmodel = "target"\nmask_token_id = {mask}\ndevice = "cpu"\n'
                   f'layers = [1, 4]\n[cache]\nmin_loss_tokens = 8\nsamples_per_shard = 3\n')
    sets = [a for s in TINY + [f"target.mask_token_id={mask}"] for a in ("--set", s)]
    p["sets"] = sets
    if built:
        return p
    code, out, err, _ = run(["data", "prepare", "--source", "good.jsonl", "-o", "prompts"], root)
    assert code == 0, err
    write_responses(str(root / "responses"), response_rows(12))
    with heavy():
        code, out, err, _ = run(["cache", "build", "-i", "responses", "-o", "cache", "--target", "target",
                                 "--layers", "1,4", "--set", "cache.min_loss_tokens=8",
                                 "--set", "cache.samples_per_shard=3", "--set", "target.device=cpu"], root)
        assert code == 0, err
        code, out, err, _ = run(["train", "-i", "cache", "-o", "train", "--max-steps", "3", *sets], root)
        assert code == 0, err
    return p


def interrupt_train(root: Path, sets: list[str]) -> Callable[[], tuple[int, str, str, float]]:
    """Ctrl-C once two checkpoints are committed; then damage the newest so the rerun must fall back."""

    def go() -> tuple[int, str, str, float]:
        started = time.time()
        proc = subprocess.Popen([dspark_script(), "train", "-i", "cache", "-o", "train-int",
                                 "--max-steps", "60", *sets], cwd=root, env=env(), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        ckpts = root / "train-int" / "checkpoints"
        deadline = time.time() + 120
        committed = lambda: sorted(c.parent for c in ckpts.glob("step-*/_COMMITTED"))  # noqa: E731
        while time.time() < deadline and proc.poll() is None and len(committed()) < 2:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        weights = committed()[-1] / "model.safetensors"  # the newest committed: resume must skip it
        weights.write_bytes(weights.read_bytes()[:100])
        return proc.returncode, out, err, time.time() - started

    return go


def cases(root: Path, p: dict) -> list[Case]:
    sets, mask = p["sets"], p["mask"]
    r = "{r}"
    regen = ["data", "regen", "-i", f"{r}/prompts", "-o", f"{r}/resp-x", "--model", "m"]
    drafter = f"{r}/train"
    busy = p["ok"].rsplit(":", 1)[1].split("/")[0]  # the fixture server's port
    ev = ["--target", f"{r}/target", "--set", "target.device=cpu", "--set", f"target.mask_token_id={mask}"]

    def truncate_export() -> None:
        src = root / "train" / "export"
        dst = root / "broken-export"
        if not dst.exists():
            shutil.copytree(src, dst)
            w = dst / "model.safetensors"
            w.write_bytes(w.read_bytes()[:300])

    def delete_shard() -> None:
        dst = root / "cache-holed"
        if not dst.exists():
            shutil.copytree(root / "cache", dst)
            shutil.rmtree(sorted((dst / "shards").iterdir())[-1])

    return [
        # ---- config and --set, every stage reads them the same way
        Case("config: a folder", ["train", "--config", f"{r}/a_folder"], ["a_folder", "folder"]),
        Case("config: not UTF-8", ["train", "--config", f"{r}/latin1.toml"], ["latin1.toml", "UTF-8"]),
        Case("config: TOML syntax", ["train", "--config", f"{r}/syntax.toml"], ["syntax.toml", "line 2"]),
        Case("config: unknown key", ["train", "--config", f"{r}/typo_key.toml"], ["learning_rate"]),
        Case("config: unknown section", ["train", "--config", f"{r}/typo_section.toml"], ["trian"]),
        Case("config: missing file", ["cache", "build", "--config", f"{r}/trail.toml"], ["trail.toml"]),
        Case("--set: not a number", ["train", "--set", "train.lr=fast"], ["train.lr"]),
        Case("--set: no such key", ["train", "--set", "train.lrr=1e-3"], ["train.lrr"]),
        Case("--set: no '='", ["train", "--set", "train.lr"], ["--set", "train.lr"]),
        Case("--set: NaN", ["train", "--set", "train.lr=nan"], ["train.lr", "finite"]),
        # ---- data prepare
        Case("prepare: typo'd source", ["data", "prepare", "--source", "good.jsnol", "-o", f"{r}/p1"],
             ["good.jsnol", "good.jsonl"],
             rerun=["data", "prepare", "--source", "good.jsonl", "-o", f"{r}/p1"]),
        Case("prepare: .gz that is not gzip", ["data", "prepare", "--source", f"{r}/notgzip.jsonl.gz",
                                               "-o", f"{r}/p2"], ["notgzip.jsonl.gz", "gzip"],
             rerun=["data", "prepare", "--source", f"{r}/good.jsonl", "-o", f"{r}/p2"]),
        Case("prepare: binary source", ["data", "prepare", "--source", f"{r}/binary.bin", "-o", f"{r}/p3"],
             ["binary.bin"]),
        Case("prepare: BOM in JSONL (fine)", ["data", "prepare", "--source", f"{r}/bom.jsonl",
                                              "-o", f"{r}/p4", "--val-fraction", "0"], code=0),
        Case("prepare: output is the user's file", ["data", "prepare", "--source", f"{r}/good.jsonl",
                                                    "-o", f"{r}/notes.txt"], ["notes.txt"]),
        Case("prepare: output is the user's folder", ["data", "prepare", "--source", f"{r}/good.jsonl",
                                                      "-o", f"{r}/mine"], ["mine"]),
        Case("prepare: output under a file", ["data", "prepare", "--source", f"{r}/good.jsonl",
                                              "-o", f"{r}/notes.txt/p"], ["notes.txt", "not a dir"]),
        Case("prepare: output cannot be created", ["data", "prepare", "--source", f"{r}/good.jsonl",
                                                   "-o", "/proc/no/such"], ["/proc/no"]),
        Case("prepare: --val-fraction 1.5", ["data", "prepare", "--source", f"{r}/good.jsonl",
                                             "-o", f"{r}/p5", "--val-fraction", "1.5"], ["val"]),
        Case("prepare: --limit x", ["data", "prepare", "--source", f"{r}/good.jsonl", "--limit", "x"],
             ["--limit"]),
        Case("prepare: output is its own input", ["data", "prepare", "--source", f"{r}/good.jsonl",
                                                  "-o", f"{r}/good.jsonl"], ["good.jsonl"]),
        # ---- data regen
        Case("regen: endpoint without http://", [*regen, "--endpoint", "localhost:18001/v1"],
             ["--endpoint", "http://"]),
        Case("regen: password in endpoint", [*regen, "--endpoint", "http://al:hunter2pw@127.0.0.1:9/v1"],
             ["--endpoint", "credentials"], secret="hunter2pw"),
        Case("regen: endpoint refused", [*regen, "--endpoint", "http://127.0.0.1:9/v1"],
             ["127.0.0.1:9", "refused"], max_seconds=30),
        Case("regen: --temperature nan", [*regen, "--endpoint", "http://127.0.0.1:9/v1",
                                          "--temperature", "nan"], ["--temperature"]),
        Case("regen: input is not prompts", ["data", "regen", "-i", f"{r}/a_folder", "-o", f"{r}/resp-y",
                                             "--endpoint", "http://127.0.0.1:9/v1", "--model", "m"],
             ["a_folder"]),
        Case("regen: binary manifest", ["data", "regen", "-i", f"{r}/binmf", "-o", f"{r}/resp-z",
                                        "--endpoint", "http://127.0.0.1:9/v1", "--model", "m"],
             ["binmf/manifest.json"],
             before=lambda: ((root / "binmf").mkdir(exist_ok=True),
                             (root / "binmf" / "manifest.json").write_bytes(b"\x89PNG\xff\xfe"))),
        Case("regen: API key variable unset", [*regen, "--endpoint", "http://127.0.0.1:9/v1",
                                               "--api-key-env", "TRIAL_UNSET_KEY"], ["TRIAL_UNSET_KEY"]),
        Case("regen: a model the server does not serve", [*regen[:-1], "llama", "--endpoint", p["ok"]],
             ["llama", "m"]),
        Case("regen: every request fails (500)", ["data", "regen", "-i", f"{r}/prompts",
                                                  "-o", f"{r}/resp-500", "--model", "m",
                                                  "--endpoint", p["broken"], "--max-retries", "0"],
             ["500"], code=1, max_seconds=60,
             rerun=["data", "regen", "-i", f"{r}/prompts", "-o", f"{r}/resp-500", "--model", "m",
                    "--endpoint", p["ok"], "--max-retries", "0"]),
        # ---- cache
        Case("cache estimate: typo'd local target", ["cache", "estimate", "-i", f"{r}/responses", "--target",
                                                     f"{r}/targte", "--layers", "1,4"], ["targte"],
             max_seconds=30),
        Case("cache estimate: hub-like id offline", ["cache", "estimate", "-i", f"{r}/responses", "--target",
                                                     "runs/models/smollm2-135m-instrct"],
             ["smollm2-135m-instrct"], max_seconds=30),
        Case("cache build: --layers 1,x", ["cache", "build", "-i", f"{r}/responses", "-o", f"{r}/c1",
                                           "--target", f"{r}/target", "--layers", "1,x"], ["--layers"]),
        Case("cache build: layer out of range", ["cache", "build", "-i", f"{r}/responses", "-o", f"{r}/c2",
                                                 "--target", f"{r}/target", "--layers", "1,40"], ["40"]),
        Case("cache build: output is the user's file", ["cache", "build", "-i", f"{r}/responses",
                                                        "-o", f"{r}/notes.txt", "--target", f"{r}/target",
                                                        "--layers", "1,4"], ["notes.txt"]),
        Case("cache build: input is prompts", ["cache", "build", "-i", f"{r}/prompts", "-o", f"{r}/c3",
                                               "--target", f"{r}/target", "--layers", "1,4"], ["prompts"]),
        Case("cache build: --storage-dtype fp16", ["cache", "build", "-i", f"{r}/responses", "-o", f"{r}/c4",
                                                   "--storage-dtype", "fp16"], ["--storage-dtype", "fp16"]),
        Case("cache build: output inside its input", ["cache", "build", "-i", f"{r}/responses",
                                                       "-o", f"{r}/responses/cache", "--layers", "1,4",
                                                       "--target", f"{r}/target"], ["responses", "inside"]),
        # ---- train
        Case("train: missing cache", ["train", "-i", f"{r}/cahce", "-o", f"{r}/t1", *sets], ["cahce"]),
        Case("train: deleted shard", ["train", "-i", f"{r}/cache-holed", "-o", f"{r}/t2", "--max-steps", "2",
                                      *sets], ["shard", "missing"], before=delete_shard),
        Case("train: mask token is eos", ["train", "-i", f"{r}/cache", "-o", f"{r}/t3", *sets,
                                          "--set", f"target.mask_token_id={p['eos']}"], ["mask_token_id"]),
        Case("train: output is the user's folder", ["train", "-i", f"{r}/cache", "-o", f"{r}/mine",
                                                    "--max-steps", "2", *sets], ["mine"]),
        Case("train: Ctrl-C, then a damaged newest checkpoint", [], ["interrupted"], code=130,
             runner=interrupt_train(root, sets), heavy=True,
             rerun=["train", "-i", f"{r}/cache", "-o", f"{r}/train-int", "--max-steps", "60", *sets],
             rerun_says="skipping checkpoint"),
        # ---- export
        Case("export: onto the user's file", ["export", drafter, f"{r}/notes.txt"], ["notes.txt"]),
        Case("export: onto the user's folder", ["export", drafter, f"{r}/mine"], ["mine"]),
        Case("export: truncated weights", ["export", f"{r}/broken-export", f"{r}/e1"],
             ["broken-export/model.safetensors"], before=truncate_export),
        Case("export: not a drafter", ["export", f"{r}/a_folder", f"{r}/e2"], ["a_folder"]),
        Case("export check: not an export", ["export", "check", f"{r}/a_folder"], ["a_folder"]),
        # ---- calibrate / eval / profile
        Case("eval: missing drafter", ["eval", "--drafter", f"{r}/trian", "--dataset", f"{r}/eval.jsonl",
                                       *ev, "-o", f"{r}/ev1"], ["trian"]),
        Case("eval: --schedule typo", ["eval", "--drafter", drafter, "--schedule", "algorithm-1", *ev],
             ["--schedule", "algorithm-1"]),
        Case("eval: a bad dataset row", ["eval", "--drafter", drafter, "--dataset", f"{r}/bad_eval.jsonl",
                                         *ev, "-o", f"{r}/ev2", "--max-new-tokens", "4"],
             ["bad_eval.jsonl", "2"]),
        Case("eval: truncated drafter weights", ["eval", "--drafter", f"{r}/broken-export", "--dataset",
                                                 f"{r}/eval.jsonl", *ev, "-o", f"{r}/ev3"],
             ["broken-export/model.safetensors"], before=truncate_export),
        Case("calibrate: dataset missing", ["calibrate", "--drafter", drafter, "--dataset", f"{r}/nope.jsonl",
                                            *ev, "-o", f"{r}/cal1"], ["nope.jsonl"]),
        Case("profile: --batch-tokens 1,x", ["profile", "--target", f"{r}/target", "--batch-tokens", "1,x"],
             ["--batch-tokens"]),
        Case("profile: missing target", ["profile", "--target", f"{r}/no-target", "-o", f"{r}/prof"],
             ["no-target"]),
        Case("eval: --calibration not JSON", ["eval", "--drafter", drafter, "--dataset",
                                              f"{r}/eval.jsonl", "--calibration", f"{r}/notes.txt",
                                              *ev, "-o", f"{r}/ev4"],
             ["notes.txt"]),
        Case("calibrate: --num-prompts 0", ["calibrate", "--drafter", drafter, "--num-prompts", "0", *ev],
             ["--num-prompts"]),
        Case("export check: --calibration not JSON", ["export", "check", f"{r}/train/export",
                                                      "--calibration", f"{r}/notes.txt"], ["notes.txt"]),
        # ---- serve / model convert
        Case("serve: --port 99999", ["serve", f"{r}/target", "--port", "99999"], ["--port"]),
        Case("serve: --threads -1", ["serve", f"{r}/target", "--threads", "-1"], ["--threads"]),
        Case("serve: missing model", ["serve", f"{r}/no-target", "--port", "0"], ["no-target"]),
        Case("convert: fake .gguf", ["model", "convert", f"{r}/fake.gguf", f"{r}/m1"], ["fake.gguf"]),
        Case("convert: onto the user's folder", ["model", "convert", f"{r}/target", f"{r}/mine"], ["mine"]),
        Case("serve: port already in use", ["serve", f"{r}/target", "--port", busy], ["--port", busy]),
        Case("convert: onto the user's file", ["model", "convert", f"{r}/target", f"{r}/notes.txt"],
             ["notes.txt"]),
        Case("convert: missing source", ["model", "convert", f"{r}/nope.gguf", f"{r}/m2"], ["nope.gguf"]),
        # ---- pipeline / plan
        Case("pipeline new: -o in a missing folder (fine)", ["pipeline", "new", "--target", f"{r}/target",
                                                              "-o", f"{r}/new/sub/my.toml"], code=0),
        Case("pipeline new: -o onto the user's file", ["pipeline", "new", "--target", f"{r}/target",
                                                       "-o", f"{r}/notes.txt"], ["notes.txt"]),
        Case("pipeline new: missing target", ["pipeline", "new", "--target", f"{r}/no-target",
                                              "-o", f"{r}/n2.toml"], ["no-target"]),
        Case("pipeline run: endpoint down", ["pipeline", "run", f"{r}/regen.toml",
                                             "--stages", "prepare,regen"],
             ["regen", "127.0.0.1:9"], max_seconds=30,
             before=lambda: (root / "regen.toml").write_text(
                 '[pipeline]\nwork_dir = "work-regen"\n[data]\nsource = "good.jsonl"\n'
                 '[regen]\nendpoints = ["http://127.0.0.1:9/v1"]\nmodel = "m"\n')),
        Case("pipeline run: --stages typo", ["pipeline", "run", f"{r}/trial.toml",
                                             "--stages", "prepare,cahce"],
             ["cahce"]),
        Case("pipeline show: missing config", ["pipeline", "show", f"{r}/trail.toml"], ["trail.toml"]),
        Case("pipeline report: nothing run yet", ["pipeline", "report", f"{r}/fresh.toml"], ["fresh.toml"],
             before=lambda: (root / "fresh.toml").write_text('[pipeline]\nwork_dir = "nothing-yet"\n')),
        Case("plan: --gpus 0", ["plan", str(REPO / "pipelines/qwen3-4b.toml"), "--gpus", "0"], ["--gpus"]),
        Case("plan: --tflops nan", ["plan", str(REPO / "pipelines/qwen3-4b.toml"), "--tflops", "nan"],
             ["--tflops"]),
        Case("plan: missing config", ["plan", "pipelines/qwen3-4.toml"], ["qwen3-4.toml"]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", default="", help="also write the results here")
    parser.add_argument("--only", default="", help="run only the cases whose name starts with this")
    parser.add_argument("--keep", action="store_true", help="keep the work folder")
    parser.add_argument("--reuse", default="", help="a folder kept by --keep: skip the set-up's builds")
    parser.add_argument("--no-lock", action="store_true", help=f"do not take {LOCK} (a machine of one's own)")
    args = parser.parse_args()
    global USE_LOCK
    USE_LOCK = not args.no_lock
    root = Path(args.reuse) if args.reuse else Path(tempfile.mkdtemp(prefix="dspark-trial-"))
    started = time.time()
    from fixtures.openai_server import start_openai_server

    ok = start_openai_server(model="m")
    broken = start_openai_server(model="m", faults={"error_500": 1.0})
    try:
        p = setup(root)
        p["ok"], p["broken"] = ok.url, broken.url
        todo = [c for c in cases(root, p) if c.name.startswith(args.only)]
        todo.sort(key=lambda c: c.heavy)  # the ones that wait for the lock last
        results = []
        for case in todo:
            before_files = snapshot(p["user"])
            res = judge(case, root, p["user"], before_files)
            results.append(res)
            print(f"[{res.verdict:7}] {res.name} ({res.code}, {res.seconds:.1f}s): {res.message}"
                  + (f"  <-- {res.why}" if res.why else ""), flush=True)
    finally:
        ok.stop()
        broken.stop()
        if not (args.keep or args.reuse):
            shutil.rmtree(root, ignore_errors=True)
    counts = {v: sum(r.verdict == v for r in results) for v in ("clear", "unclear", "bad")}
    print(f"\n{len(results)} cases: {counts['clear']} clear, {counts['unclear']} unclear, "
          f"{counts['bad']} bad ({time.time() - started:.0f}s)")
    for r in results:
        if r.verdict != "clear":
            print(f"  {r.verdict}: {r.name}: {r.command}\n    {r.message}\n    ({r.why})")
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in results], indent=1, ensure_ascii=False))
    sys.exit(1 if counts["bad"] else 0)


if __name__ == "__main__":
    main()
