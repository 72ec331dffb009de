"""The export folder's README.md: what was trained, on what, how well, and how to serve it.

    card = write_card("runs/x/train/export")    # after train, calibrate and eval (each rewrites it)

Everything comes from the artifacts the pipeline left beside the export (<work_dir>/train,
cache, calibration, eval, profile), read through their manifests; whatever is absent is said
to be. The launch commands are `dspark export check`'s, so the card and the check never differ.
"""

from __future__ import annotations

from typing import Any

from .. import storage
from .engine_check import CheckReport, check_export, render

CARD = "README.md"


def _read(url: str) -> dict[str, Any] | None:
    try:
        return storage.read_json(url) if storage.exists(url) else None
    except (OSError, ValueError):
        return None


def _parent(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[0]


def _ece_line(cal: dict[str, Any]) -> str:
    """The pooled ECE as calibrate reports it (out of sample when cross-fitted), or ''."""
    from ..decode.calibrate import summary

    try:
        s = summary(cal)
    except (KeyError, TypeError):
        return ""
    if not all(isinstance(s[k], int | float) for k in ("ece_before", "ece_after")):
        return ""
    where = " out of sample (cross-fitted)" if s["out_of_sample"] else ""
    return f"; ECE{where} {s['ece_before']:.4f} → {s['ece_after']:.4f}"


def sibling_artifacts(export_url: str) -> dict[str, str]:
    """URLs of the files a card reads, for an export at <work_dir>/train/export."""
    train = _parent(export_url)
    work = _parent(train)
    return {"train": storage.join(train, "manifest.json"),
            "cache": storage.join(work, "cache", "manifest.json"),
            "calibration": storage.join(work, "calibration", "calibration.json"),
            "eval": storage.join(work, "eval", "report.json"),
            "sps": storage.join(work, "profile", "sps.json")}


def _training(lines: list[str], train: dict[str, Any] | None, cache: dict[str, Any] | None) -> None:
    lines.append("## Training")
    if cache:
        counts = ", ".join(f"{k} {v}" for k, v in cache.get("counts", {}).items())
        lines.append(f"- data: the target's own features, cache of {counts or 'unknown size'}")
    else:
        lines.append("- data: no cache manifest beside this export")
    if train:
        c, extra = train.get("counts", {}), train.get("extra", {})
        tc = train.get("config", {}).get("train", {})
        lines.append(f"- budget: {c.get('steps', '?')} steps × global batch {tc.get('global_batch', '?')} "
                     f"({c.get('samples_seen', '?')} samples seen of {c.get('train_samples', '?')}), "
                     f"lr {tc.get('lr', '?')}, {tc.get('num_anchors', '?')} anchors per sample")
        held = extra.get("validation") or {}
        if held.get("accepted_length") is not None:
            lines.append(f"- held-out (teacher-forced): τ {held['accepted_length']:.2f}, "
                         f"loss {held.get('loss', float('nan')):.4f}")
    else:
        lines.append("- budget: no train manifest beside this export")


def _results(lines: list[str], cal: dict[str, Any] | None, report: dict[str, Any] | None) -> None:
    lines.append("## Results")
    if report:
        lines.append(f"`dspark eval` at T={report.get('temperature')}, schedule {report.get('schedule')}:")
        lines.append("")
        lines.append("| dataset | τ | acceptance | speed-up |")
        lines.append("|---|---|---|---|")
        for d in report.get("datasets", []):
            tps = d.get("tokens_per_second") or {}
            f = (lambda v: f"{v:.3f}" if isinstance(v, int | float) else "—")  # noqa: E731
            lines.append(f"| {d.get('name')} | {f(d.get('tau'))} | {f(d.get('acceptance_rate'))} | "
                         f"{f(tps.get('speedup'))} |")
    else:
        lines.append("- no `dspark eval` report beside this export yet")
    if cal and "temperatures" in cal:
        temps = ", ".join(f"{t:.3g}" for t in cal["temperatures"])
        ece = _ece_line(cal)
        lines.append(f"- calibration (STS): T = [{temps}] over {cal.get('num_samples', '?')} rounds{ece}")
    else:
        lines.append("- calibration: none (no confidence head, or `dspark calibrate` not run)")


def card_text(export_url: str, check: CheckReport) -> str:
    files = sibling_artifacts(export_url)
    cfg = _read(storage.join(export_url, "config.json")) or {}
    train, cache = _read(files["train"]), _read(files["cache"])
    cal, report = _read(files["calibration"]), _read(files["eval"])
    kind = cfg.get("dspark_cli_config", {})
    lines = [f"# {check.architecture} drafter for {check.target}", "",
             f"Trained with dspark. γ = {check.gamma}, {kind.get('num_draft_layers', '?')} draft layers, "
             f"block convention {kind.get('block_convention', '?')}, Markov head "
             f"{kind.get('markov_head_type', '?')} (rank {kind.get('markov_rank', '?')}), confidence head "
             f"{'yes' if kind.get('enable_confidence_head') else 'no'}; target layers "
             f"{cfg.get('target_layer_ids')}, mask token id {cfg.get('mask_token_id')}.", ""]
    _training(lines, train, cache)
    lines.append("")
    _results(lines, cal, report)
    lines += ["", "## Serving", "", "```", render(check), "```", ""]
    return "\n".join(lines)


def write_card(export_url: str) -> CheckReport:
    """(Re)write <export>/README.md with the STS / SPS files found beside it; return the check."""
    files = sibling_artifacts(export_url)
    calibration = files["calibration"] if storage.exists(files["calibration"]) else None
    sps = files["sps"] if storage.exists(files["sps"]) else None
    check = check_export(export_url, calibration=calibration, sps=sps)
    storage.write_text(storage.join(export_url, CARD), card_text(export_url, check))
    return check


def refresh_card(drafter_url: str) -> str | None:
    """After train / calibrate / eval: rewrite the card of the export behind drafter_url and return
    the check's one-line summary (None when drafter_url is no export, e.g. a bare checkpoint).

    A card that cannot be written must not fail the stage that just succeeded: its error becomes
    the line instead.
    """
    from ..errors import DsparkError
    from .engine_check import summary_line
    from .export import resolve_drafter_url

    url = resolve_drafter_url(drafter_url)
    if not storage.exists(storage.join(url, "config.json")):
        return None
    try:
        return summary_line(write_card(url))
    except (DsparkError, OSError, ValueError, KeyError) as e:
        return f"engines: not checked ({e})"
