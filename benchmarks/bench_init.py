"""How a fresh drafter's initial final-norm gain changes a short SmolLM2 training (docs/train.md).

    .venv/bin/python benchmarks/bench_init.py                  # gains 1, 0, 0.2, 0.5; 40 steps each
    .venv/bin/python benchmarks/bench_init.py --gains 1 0.5 --steps 20

No regeneration (too slow on a shared 2-core machine): each of 160 bundled prompts is answered
with the text of another bundled prompt, natural text whose target distribution the cache still
records. One cache, then one `dspark train` per gain (same seed, samples and anchors), with
`DSparkDrafter`'s init patched to that gain; prints step-1 loss and CE, mean losses of the first
and last ten steps, and the validation loss and τ.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

CFG = "pipelines/smollm2-135m.toml"
TARGET = "runs/models/smollm2-135m-instruct"

TRAIN_WITH_GAIN = """
import sys, torch
from dspark_cli.model.drafter import DSparkDrafter
original = DSparkDrafter._init_weights
def init(self):
    original(self)
    torch.nn.init.constant_(self.norm.weight, float(sys.argv[1]))
DSparkDrafter._init_weights = init
from dspark_cli.cli import main
main(sys.argv[2:])
"""


def build_cache(work: Path) -> None:
    from dspark_cli import storage
    from dspark_cli.data.io import RESPONSE_SCHEMA, shard_name, write_table

    if (work / "cache" / "manifest.json").is_file():
        return
    prompts = [json.loads(line) for line in (REPO / "dspark_cli/resources/demo_prompts.jsonl").open()][:160]
    rows = [{"id": p["id"], "source": "demo", "split": "validation" if i % 10 == 9 else "train",
             "messages": [{"role": "user", "content": p["turns"][0]},
                          {"role": "assistant", "content": prompts[(i * 7 + 3) % len(prompts)]["turns"][0]}],
             "reasoning": [None], "thinking": False, "model": "none", "endpoint": "none", "sampling": "{}",
             "finish_reasons": ["stop"], "prompt_tokens": 0, "completion_tokens": 0}
            for i, p in enumerate(prompts)]
    for k in range(0, len(rows), 64):
        write_table(storage.join(str(work / "responses"), "data", shard_name(k // 64)), rows[k:k + 64],
                    RESPONSE_SCHEMA)
    subprocess.run([sys.executable, "-m", "dspark_cli.cli", "cache", "build", "-c", CFG, "--set",
                    f"pipeline.work_dir={work}", "--responses", str(work / "responses")],
                   cwd=REPO, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="runs/bench-init")
    ap.add_argument("--gains", type=float, nargs="+", default=[1.0, 0.0, 0.2, 0.5])
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    work = (REPO / args.work).resolve()
    if not (REPO / TARGET / "conversion.json").is_file():
        subprocess.run([sys.executable, "-m", "dspark_cli.cli", "model", "convert", "--smollm2", TARGET],
                       cwd=REPO, check=True)
    build_cache(work)
    for gain in args.gains:
        out = work / f"train-gain{gain:g}-{args.steps}"
        subprocess.run([sys.executable, "-c", TRAIN_WITH_GAIN, str(gain), "train", "-c", CFG, "--set",
                        f"pipeline.work_dir={work}", "--cache", str(work / "cache"), "-o", str(out),
                        "--set", f"train.max_steps={args.steps}", "--set", "train.log_every=1",
                        "--set", "train.save_every=1000", "--set", "train.eval_samples=16"],
                       cwd=REPO, check=True)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").open()]
        val = json.loads((out / "manifest.json").read_text())["extra"]["validation"]

        def mean(part: list[dict]) -> float:
            return sum(r["loss"] for r in part) / len(part)

        print(f"gain {gain:g}: step-1 loss {rows[0]['loss']:.3f} (CE {rows[0]['ce']:.2f}), mean loss "
              f"first 10 {mean(rows[:10]):.3f}, last 10 {mean(rows[-10:]):.3f}; validation loss "
              f"{val['loss']:.4f}, τ {val['accepted_length']:.4f}, slot-1 acceptance "
              f"{val['slot_acceptance'][0]:.3f}", flush=True)


if __name__ == "__main__":
    main()
