"""The library side of `dspark eval`, `dspark calibrate` and `dspark profile` (usable without the CLI).

Each takes a PipelineConfig plus URLs, goes through `manifest.prepare_stage` (skip when done,
refuse a changed config, resume otherwise), claims the output only once its inputs are read and its
models loaded, writes its manifest last and returns a `StageResult`. Eval commits one part file
per finished dataset, so a killed run redoes only the dataset it was in. Torch, Transformers and
matplotlib are imported only after the inputs are checked: a wrong path fails in well under a second.
"""

from __future__ import annotations

import math
from typing import Any

from .. import manifest, storage
from ..config import PipelineConfig
from ..console import console
from ..errors import DsparkError, StageFailed
from ..schemas import validate
from ..stage import StageResult, already_done, completed
from ..target import identity
from ..target.layers import agree_layers
from .calibrate import RoundRecords, calibration_file, cross_fit, fit_sts
from .prompts import dataset_name, load_conversations
from .report import dataset_report, records
from .scheduler import Scheduler
from .sps import SpsTable, default_batch_grid, profile_target


def _target_input(cfg: PipelineConfig, target: str, output_url: str) -> str:
    """The target's fingerprint as this stage's input (an earlier release's spelling still matches)."""
    t = cfg.target
    return identity.fingerprint(target, t.revision, t.trust_remote_code,
                                previous=manifest.recorded_input(output_url, target))


def load_models(cfg: PipelineConfig, target: str, drafter_url: str) -> tuple[Any, Any, Any]:
    from ..model.block_sampler import compile_wanted
    from ..model.export import load_drafter
    from ..target.model import Target
    from ..target.prepack import prepack_linears
    from ..train.checkpoint import say_if_unrefit

    say_if_unrefit(drafter_url)
    loaded = Target.from_settings(cfg.target, path=target)
    # The drafter computes in the target's dtype: on CPUs with native bf16 a bf16 draft round was
    # measured 3x faster than fp32 (issue 16; bench-decode prints both).
    drafter = load_drafter(drafter_url, target=target, device=loaded.device, dtype=loaded.dtype)
    if cfg.target.prepack:  # frozen here too, and its block forward is a few-row GEMM as well
        prepack_linears(drafter)
    drafter.compile_sampler(compile_wanted(cfg.target.compile_draft, loaded.device))
    return loaded.model, loaded.tokenizer, drafter


def drafter_block_size(cfg: PipelineConfig, drafter_url: str) -> int:
    """γ of a drafter from its config alone (fails early, with the model loaders' message).

    The drafter's layers are the truth; explicit `target.layers` that differ are refused here,
    before any output is claimed.
    """
    from ..model.locate import read_config, resolve_drafter_url

    url = resolve_drafter_url(drafter_url)
    config = read_config(url)
    agree_layers(cfg.target.layers, list(config.target_layer_ids), f"the drafter {url}")
    return int(config.block_size)


def load_calibration(url: str, gamma: int | None = None) -> list[float]:
    """T_1..T_γ of an STS file, this release's (v2) or the previous one's (v1)."""
    obj = storage.read_json(url)
    validate(obj, "calibration", where=url)
    temps = [float(t) for t in obj["temperatures"]]
    for key in ("ece_before", "ece_after"):  # v2's per-position lists (v1 wrote pooled numbers)
        if isinstance(obj[key], list) and len(obj[key]) != len(temps):
            raise DsparkError(f"{url}: {key} has {len(obj[key])} positions but there are {len(temps)} "
                              "temperatures.", hint="rewrite it with `dspark calibrate --force`.")
    if gamma is not None and len(temps) != gamma:
        raise DsparkError(f"{url}: {len(temps)} temperatures, but the drafter drafts γ = {gamma} tokens.",
                          hint="calibrate this drafter with `dspark calibrate`.")
    return temps


# ---- eval ------------------------------------------------------------------------------------

def run_eval(cfg: PipelineConfig, target: str, drafter_url: str, output_url: str,
             force: bool = False) -> StageResult:
    """Decode every dataset speculatively (and with the target alone); write report.json + plot.

    The summary is the report itself (report.json: what `dspark eval` prints as tables)."""
    ev = cfg.eval
    if not ev.datasets:
        raise DsparkError("no eval dataset given.", hint="pass --dataset FILE.jsonl (repeatable).")
    # Every input is read and checked before the output is claimed, so a typo costs no --force.
    conversations = {url: load_conversations(url, ev.limit, ev.split) for url in ev.datasets}
    gamma = drafter_block_size(cfg, drafter_url)
    sps = SpsTable.load(ev.sps) if ev.sps else None
    temps = load_calibration(ev.calibration, gamma) if ev.calibration else None
    inputs = {u: manifest.fingerprint(u) for u in [drafter_url, *ev.datasets]}
    inputs[target] = _target_input(cfg, target, output_url)
    for extra in (ev.sps, ev.calibration):
        if extra:
            inputs[extra] = manifest.fingerprint(extra)
    config = {"eval": ev.to_dict(), "target": {"dtype": cfg.target.dtype, "prepack": cfg.target.prepack}}
    run = manifest.prepare_stage("eval", output_url, config, inputs, force)
    if run.state == "done":
        return already_done(run, lambda _m: storage.read_json(storage.join(output_url, "report.json")))
    model, tokenizer, drafter = load_models(cfg, target, drafter_url)
    run.claim()  # only once the models loaded: a wrong --target or --drafter leaves nothing behind
    storage.clean_temporaries(output_url)
    from ..target.prepack import packed_count
    from . import plots
    prepacked = packed_count(model)
    console.print(f"  target: {prepacked} linears prepacked" if prepacked
                  else "  target: plain linears (no prepacking here: target/prepack.py)")
    from .specdec import SpeculativeDecoder, paired_decode, target_only, warm_up
    datasets = []
    for url in ev.datasets:
        name = dataset_name(url)
        part = storage.join(output_url, "parts", f"{len(datasets):03d}-{name}.json")
        if storage.exists(part):
            console.print(f"  {name}: already decoded, reusing {part}")
            datasets.append(storage.read_json(part))
            continue
        convs = conversations[url]
        console.print(f"  {name}: {len(convs)} conversations, schedule {ev.schedule}, R={ev.concurrency}")

        def decode(concurrency: int, convs=convs, max_new_tokens: int = ev.max_new_tokens) -> Any:
            scheduler = Scheduler(ev.schedule, drafter.block_size, sps, threshold=ev.threshold)
            decoder = SpeculativeDecoder(model, tokenizer, drafter, scheduler, temperature=ev.temperature,
                                         max_new_tokens=max_new_tokens, thinking=ev.thinking,
                                         temperatures=temps, seed=ev.seed, draft_top_k=ev.draft_top_k)
            return decoder.run(convs, concurrency)

        warm_up(lambda few, tokens: decode(1, few, tokens), model, tokenizer, convs, baseline=ev.baseline,
                temperature=ev.temperature, thinking=ev.thinking, seed=ev.seed)
        def target_alone(few: list) -> Any:
            return target_only(model, tokenizer, few, temperature=ev.temperature,
                               max_new_tokens=ev.max_new_tokens, thinking=ev.thinking, seed=ev.seed)

        baseline = None
        paired = ev.baseline and ev.concurrency == 1  # R > 1 decodes conversations together: not pairable
        if paired:
            stats, baseline = paired_decode(lambda few: decode(1, few), target_alone, convs)
        else:
            stats = decode(ev.concurrency)
        sweep = []
        for r in ev.concurrency_sweep:
            from .report import scheduler_summary

            sweep.append(scheduler_summary(decode(r), ev.schedule, r))
        if ev.baseline and not paired:
            baseline = target_alone(convs)
        report = dataset_report(name, url, len(convs), stats, baseline, ev.schedule, ev.concurrency,
                                ev.sweep_thresholds, temps, sweep,
                                timing="paired" if paired else "sequential")
        storage.write_json(part, report)
        datasets.append(report)
    report = {
        "schema_version": 1, "target": target, "drafter": drafter_url, "block_size": drafter.block_size,
        "temperature": ev.temperature, "max_new_tokens": ev.max_new_tokens, "thinking": ev.thinking,
        "schedule": ev.schedule, "concurrency": ev.concurrency, "calibration": ev.calibration or None,
        "sps": ev.sps or None, "target_prepacked": prepacked, "datasets": datasets,
    }
    validate(report, "eval_report", where=storage.join(output_url, "report.json"))
    plots.acceptance_plot(datasets, storage.join(output_url, "acceptance.png"))
    plots.threshold_plot(datasets, storage.join(output_url, "threshold_sweep.png"))
    storage.write_json(storage.join(output_url, "report.json"), report)
    counts = {"datasets": len(datasets), "rounds": sum(d["rounds"] for d in datasets),
              "new_tokens": sum(d["new_tokens"] for d in datasets)}
    final = run.finish(counts, extra={"tau": {d["name"]: d["tau"] for d in datasets}})
    return completed(run, final, report)


# ---- calibrate -------------------------------------------------------------------------------

def calibration_rounds(cfg: PipelineConfig, model: Any, tokenizer: Any, drafter: Any,
                       convs: list) -> RoundRecords | None:
    """The rounds STS is fitted on: every slot verified (fixed schedule), `[calibrate]` sampling."""
    from .specdec import SpeculativeDecoder

    cal = cfg.calibrate
    decoder = SpeculativeDecoder(model, tokenizer, drafter, Scheduler("fixed", drafter.block_size),
                                 temperature=cal.temperature, max_new_tokens=cal.max_new_tokens,
                                 thinking=cal.thinking, seed=cal.seed)
    return records(decoder.run(convs, cal.concurrency))


def run_calibrate(cfg: PipelineConfig, target: str, drafter_url: str, dataset_url: str, output_url: str,
                  force: bool = False) -> StageResult:
    """Decode held-out prompts with full verification, fit STS, write calibration.json + plot.

    The summary is `calibration_summary`'s (temperatures, ECE before/after, rounds, the file), or
    {"skipped": why} for a drafter without a confidence head (state "skipped")."""
    cal = cfg.calibrate
    drafter_block_size(cfg, drafter_url)  # the drafter first: without one there is nothing to calibrate
    split = None if dataset_url.endswith((".jsonl", ".json")) else cal.split
    convs = load_conversations(dataset_url, cal.num_prompts, split)
    inputs = {drafter_url: manifest.fingerprint(drafter_url), dataset_url: manifest.fingerprint(dataset_url),
              target: _target_input(cfg, target, output_url)}
    config = {"calibrate": cal.stage_dict(), "target": {"dtype": cfg.target.dtype}}
    run = manifest.prepare_stage("calibrate", output_url, config, inputs, force)
    if run.state == "done":
        return already_done(run, lambda found: calibration_summary(output_url, found))
    model, tokenizer, drafter = load_models(cfg, target, drafter_url)
    run.claim()  # only once the models loaded: a wrong --target or --drafter leaves nothing behind
    if not drafter.config.enable_confidence_head:
        # A DFlash baseline has nothing to calibrate; finishing (rather than failing) keeps a
        # whole-pipeline run going, and eval then uses the fixed schedule without calibration.
        console.print(f"[yellow]![/] calibrate: {drafter_url} has no confidence head; nothing to calibrate.")
        final = run.finish({"rounds": 0, "conversations": 0}, extra={"skipped": "no confidence head"})
        return completed(run, final, calibration_summary(output_url, final), skipped=True)
    console.print(f"  decoding {len(convs)} held-out conversations, γ={drafter.block_size} all verified")
    rec = calibration_rounds(cfg, model, tokenizer, drafter, convs)
    if rec is None or len(rec.confidences) == 0:
        run.abandon()  # nothing usable: the rerun with more or other prompts starts afresh
        raise StageFailed(f"{dataset_url}: decoding produced no rounds to calibrate on.",
                          hint="pass more or longer prompts (--set calibrate.num_prompts=…).")
    grid = {"t_min": cal.t_min, "t_max": cal.t_max, "t_steps": cal.t_steps, "bins": cal.ece_bins,
            "min_prefixes": cal.min_prefixes}
    fit = fit_sts(rec, **grid)
    cross = cross_fit(rec, **grid)
    result = calibration_file(fit, cross, dataset=dataset_url, extra={
        "block_size": rec.gamma, "drafter": drafter_url, "temperature": cal.temperature,
        "grid": {"t_min": cal.t_min, "t_max": cal.t_max, "t_steps": cal.t_steps, "ece_bins": cal.ece_bins},
        "min_prefixes": cal.min_prefixes})
    result = _finite(result)
    validate(result, "calibration", where=storage.join(output_url, "calibration.json"))
    from . import plots

    plots.reliability_plot(rec, fit.temperatures, storage.join(output_url, "reliability.png"), cal.ece_bins)
    storage.write_json(storage.join(output_url, "calibration.json"), result)
    final = run.finish({"rounds": fit.num_samples, "conversations": len(convs)},
                       extra={"temperatures": fit.temperatures, "fitted": fit.fitted,
                              "ece_before": result["pooled_ece_before"],
                              "ece_after": result["pooled_ece_after"], "ece_source": result["ece_source"]})
    return completed(run, final, calibration_summary(output_url, final))


def calibration_summary(output_url: str, found: dict[str, Any]) -> dict[str, Any]:
    """What `dspark calibrate` prints, from its manifest: the fitted temperatures and the pooled ECE
    (out of sample when ece_source is cross_fit; manifests of the previous release: in sample)."""
    extra = found["extra"]
    if "skipped" in extra:
        return {"skipped": extra["skipped"]}
    return {"temperatures": extra["temperatures"], "ece_before": extra["ece_before"],
            "ece_after": extra["ece_after"], "num_samples": found["counts"]["rounds"],
            "fitted": extra.get("fitted", [True] * len(extra["temperatures"])),
            "ece_source": extra.get("ece_source", "in_sample"),
            "calibration": storage.join(output_url, "calibration.json")}


def _finite(obj: Any) -> Any:
    """NaN (a metric over zero samples) becomes null, so the JSON stays standard."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


# ---- profile ---------------------------------------------------------------------------------

def run_profile(cfg: PipelineConfig, target: str, output_url: str, batch_tokens: list[int] | None = None,
                context_length: int = 128, repeats: int = 5, force: bool = False,
                tokens_per_row: int = 8) -> StageResult:
    """Measure SPS(B) of the target on this hardware; write sps.json + sps.png.

    The summary holds the table (batch_tokens, steps_per_second) and the sps.json URL."""
    grid = batch_tokens or default_batch_grid()
    t = cfg.target
    config = {"target": {"dtype": t.dtype, "device": t.device, "prepack": t.prepack},
              "profile": {"batch_tokens": grid, "context_length": context_length, "repeats": repeats,
                          "tokens_per_row": tokens_per_row}}
    inputs = {target: _target_input(cfg, target, output_url)}
    run = manifest.prepare_stage("profile", output_url, config, inputs, force)
    sps_url = storage.join(output_url, "sps.json")
    if run.state == "done":
        return already_done(run, lambda _m: _sps_summary(SpsTable.load(sps_url), sps_url))
    import torch

    from ..target.model import Target
    from ..target.prepack import packed_count
    from . import plots

    model = Target.from_settings(cfg.target, path=target).model
    run.claim()
    table = profile_target(model, grid, context_length=context_length, repeats=repeats,
                           tokens_per_row=tokens_per_row)
    table.meta.update({"target": target, "torch": torch.__version__, "prepacked": packed_count(model)})
    table.save(sps_url)
    plots.sps_plot(table.batch_tokens, table.steps_per_second, storage.join(output_url, "sps.png"),
                   title=f"{storage.basename(target)} on {table.meta['device']} ({table.meta['dtype']})")
    final = run.finish({"points": len(grid)}, extra={"device": table.meta["device"]})
    return completed(run, final, _sps_summary(table, sps_url))


def _sps_summary(table: SpsTable, url: str) -> dict[str, Any]:
    return {"batch_tokens": list(table.batch_tokens), "steps_per_second": list(table.steps_per_second),
            "sps": url}
