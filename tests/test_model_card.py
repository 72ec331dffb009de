"""The export's README.md: training facts, results and the engines' launch commands from the run."""

from __future__ import annotations

import json

import torch
from fixtures.drafter import drafter_config

from dspark_cli import manifest, storage
from dspark_cli.decode.sps import SpsTable
from dspark_cli.model.card import refresh_card, write_card
from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.model.export import export_drafter
from dspark_cli.model.frozen import attach_frozen


def test_card_reads_the_run_beside_the_export(tiny_qwen3_target, tmp_path):
    work = tmp_path / "work"
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target))
    attach_frozen(drafter, str(tiny_qwen3_target))
    export = str(work / "train" / "export")
    export_drafter(drafter, export)
    card = (work / "train" / "export" / "README.md")
    line = refresh_card(str(work / "train"))  # a train artifact root resolves to its export
    assert line.startswith("engines: SGLang ✓, vLLM ✓")
    text = card.read_text()
    assert f"for {tiny_qwen3_target}" in text and "no `dspark eval` report" in text
    assert "calibration: none" in text and "no train manifest" in text

    (work / "calibration").mkdir()
    (work / "calibration" / "calibration.json").write_text(json.dumps(
        {"temperatures": [1.5, 0.8, 1.0, 1.2], "dataset": "held-out", "num_samples": 37,
         "ece_before": [0.2, 0.1, 0.1, 0.2], "ece_after": [0.1, 0.05, 0.05, 0.1]}))
    SpsTable([1, 8, 32], [50.0, 45.0, 20.0]).save(str(work / "profile" / "sps.json"))
    (work / "eval").mkdir()
    (work / "eval" / "report.json").write_text(json.dumps(
        {"temperature": 1.0, "schedule": "fixed", "datasets": [
            {"name": "gsm8k", "tau": 3.25, "acceptance_rate": 0.56, "tokens_per_second": {"speedup": 1.4}}]}))
    write_card(export)
    text = card.read_text()
    assert "| gsm8k | 3.250 | 0.560 | 1.400 |" in text
    assert "T = [1.5, 0.8, 1, 1.2] over 37 rounds; ECE 0.1500 → 0.0750" in text
    sts = work / "calibration" / "calibration.json"
    assert f"--speculative-dspark-confidence-sts-path {sts}" in text
    assert "--speculative-dspark-sps-table-path " + str(work / "profile" / "sps.json") in text


def test_the_card_does_not_change_the_exports_fingerprint(tiny_qwen3_target, tmp_path):
    """Later stages rewrite the card; a stage that took the export folder as input must not see a change."""
    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target))
    attach_frozen(drafter, str(tiny_qwen3_target))
    export = str(tmp_path / "export")
    export_drafter(drafter, export)
    before = manifest.fingerprint(export)
    write_card(export)
    assert storage.exists(storage.join(export, "README.md")) and manifest.fingerprint(export) == before
    torch.nn.init.zeros_(drafter.fc.weight)
    export_drafter(drafter, export)
    assert manifest.fingerprint(export) != before
