"""`dspark pipeline report`: a pipeline's figures, read back from what its stages committed.

    report = collect(load_config("pipelines/smollm2-135m.toml"))
    for block in render(report): out.print(block)

Nothing is recomputed: stage seconds come from each stage's manifest (found through the pipeline's
own stage list, `pipeline.stage_output`), τ, conditional acceptance and speed-up per dataset from
eval's report.json, ECE before/after STS from calibrate's manifest, and the plots are the files
those stages wrote. A stage that has not finished shows as such, so the report also tells how far
an interrupted pipeline got.
"""

from __future__ import annotations

from typing import Any

from rich.table import Table

from . import manifest, storage
from .config import PipelineConfig
from .decode.report import interval_line
from .errors import DsparkError
from .pipeline import STAGES, stage_output

#: The plots each stage writes, by file name in its output folder.
PLOTS = {"calibrate": ("reliability.png",), "eval": ("acceptance.png", "threshold_sweep.png")}


def display_name(name: str) -> str:
    """demo_eval_gsm8k → GSM8K, mt-bench → MT-Bench: the paper's column names; others as they are."""
    key = name.removeprefix("demo_eval_").replace("_", "-").lower()
    return {"gsm8k": "GSM8K", "humaneval": "HumanEval", "mt-bench": "MT-Bench"}.get(key, name)


def pooled_conditional(report: dict[str, Any]) -> list[float | None]:
    """Conditional acceptance per draft position over every dataset of an eval report
    (accepted / reached, summed over datasets: each round weighs the same)."""
    gamma = report["block_size"]
    reached, accepted = [0] * gamma, [0] * gamma
    for d in report["datasets"]:
        for k in range(gamma):
            reached[k] += d["position_acceptance"]["reached"][k]
            accepted[k] += d["position_acceptance"]["accepted"][k]
    return [a / r if r else None for a, r in zip(accepted, reached, strict=True)]


def collect(cfg: PipelineConfig) -> dict[str, Any]:
    """Every figure of the report as JSON-ready data; DsparkError when no stage has finished."""
    stages = []
    manifests: dict[str, dict[str, Any] | None] = {}
    for stage in STAGES:
        url = stage_output(cfg, stage)
        found = manifest.read_manifest(url)
        manifests[stage] = found
        stages.append({"stage": stage, "output": url, "finished": found is not None,
                       "seconds": found["timings"]["wall_seconds"] if found else None})
    if not any(manifests.values()):
        raise DsparkError(f"{cfg.source or 'this config'}: no stage has finished under "
                          f"{cfg.pipeline.work_dir}.",
                          hint=f"run `dspark pipeline run {cfg.source or 'CONFIG'}` first (with the same "
                               "--set overrides).")
    result: dict[str, Any] = {"title": cfg.pipeline.title, "work_dir": cfg.pipeline.work_dir,
                              "stages": stages, "eval": None, "calibration": None, "plots": []}
    if manifests["eval"] is not None:
        report = storage.read_json(storage.join(stage_output(cfg, "eval"), "report.json"))
        result["eval"] = {
            "temperature": report["temperature"], "block_size": report["block_size"],
            "schedule": report["schedule"], "calibration": report.get("calibration"),
            "datasets": [{"name": d["name"], "conversations": d["conversations"], "tau": d["tau"],
                          "conditional": d["position_acceptance"]["conditional"],
                          "tokens_per_second": d["tokens_per_second"]["speculative"],
                          "target_tokens_per_second": d["tokens_per_second"]["target_only"],
                          "speedup": d["tokens_per_second"]["speedup"],
                          # a round's cost in target steps: the τ at which the speed-up is 1
                          "break_even_tau": (d.get("round_cost") or {}).get("cost_in_target_steps"),
                          "tau_interval": d.get("tau_interval")}  # 95% over conversations
                         for d in report["datasets"]],
            "pooled_conditional": pooled_conditional(report),
        }
    calibrated = manifests["calibrate"]
    if calibrated is not None:
        extra = calibrated["extra"]
        result["calibration"] = ({"skipped": extra["skipped"]} if "skipped" in extra else
                                 {"ece_before": extra["ece_before"], "ece_after": extra["ece_after"],
                                  "rounds": calibrated["counts"]["rounds"],
                                  "temperatures": extra["temperatures"]})
    for stage, names in PLOTS.items():
        if manifests[stage] is not None:
            for name in names:
                url = storage.join(stage_output(cfg, stage), name)
                if storage.exists(url):
                    result["plots"].append(url)
    return result


def _f(x: float | None, pattern: str = "{:.2f}") -> str:
    return "—" if x is None else pattern.format(x)


def render(report: dict[str, Any]) -> list[Table | str]:
    """The report as rich tables and lines, in reading order."""
    blocks: list[Table | str] = []
    stages = Table(title=f"{report['title']} — {report['work_dir']}")
    for col in ("stage", "seconds", "output"):
        stages.add_column(col, justify="right" if col == "seconds" else "left")
    for s in report["stages"]:
        seconds = _f(s["seconds"], "{:.1f}") if s["finished"] else "not finished"
        stages.add_row(s["stage"], seconds, s["output"])
    blocks.append(stages)
    ev = report["eval"]
    if ev is not None:
        table = Table(title=f"eval — T={ev['temperature']}, γ={ev['block_size']}, schedule {ev['schedule']}"
                            + (", calibrated" if ev["calibration"] else ""))
        for col in ("dataset", "τ", "break-even τ", "tok/s spec", "tok/s target", "speed-up",
                    "conditional acceptance by position"):
            table.add_column(col, justify="left" if col in ("dataset", "conditional acceptance by position")
                             else "right")
        for d in ev["datasets"]:
            table.add_row(display_name(d["name"]), _f(d["tau"]), _f(d.get("break_even_tau")),
                          _f(d["tokens_per_second"], "{:.1f}"),
                          _f(d["target_tokens_per_second"], "{:.1f}"), _f(d["speedup"], "{:.2f}x"),
                          " ".join(_f(c) for c in d["conditional"]))
        blocks.append(table)
        blocks.append("conditional acceptance, all datasets: "
                      + " ".join(_f(c) for c in ev["pooled_conditional"]))
        blocks += [f"{display_name(d['name'])}: "
                   f"{interval_line(d['tau_interval'], d['conversations'], d['break_even_tau'])}"
                   for d in ev["datasets"] if d.get("tau_interval")]
    else:
        blocks.append("eval: not finished (no τ, acceptance or speed-up yet)")
    cal = report["calibration"]
    if cal is None:
        blocks.append("calibrate: not finished")
    elif "skipped" in cal:
        blocks.append(f"calibrate: skipped ({cal['skipped']})")
    else:
        blocks.append(f"confidence ECE before/after STS: {_f(cal['ece_before'], '{:.2%}')} → "
                      f"{_f(cal['ece_after'], '{:.2%}')} ({cal['rounds']} rounds)")
    blocks += [f"plot: {p}" for p in report["plots"]]
    return blocks
