"""PNG figures: conditional acceptance by position, reliability diagrams, the SPS curve.

Rendered with matplotlib's Agg backend into bytes, then written through `storage` like every
artifact (so memory:// and s3:// work too).
"""

from __future__ import annotations

import io
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .. import storage  # noqa: E402
from .calibrate import RoundRecords, scale  # noqa: E402


def _save(fig: Any, url: str) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    storage.write_bytes(url, buf.getvalue())


def acceptance_plot(datasets: list[dict[str, Any]], url: str) -> None:
    """Conditional acceptance by draft position, one line per dataset (τ in the legend)."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in datasets:
        cond = d["position_acceptance"]["conditional"]
        xs = [k + 1 for k, c in enumerate(cond) if c is not None]
        ys = [c for c in cond if c is not None]
        tau = d["tau"]
        ax.plot(xs, ys, marker="o", label=f"{d['name']} (τ={tau:.2f})" if tau else d["name"])
    ax.set_xlabel("draft position k")
    ax.set_ylabel("P(accept k | positions < k accepted)")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, url)


def threshold_plot(datasets: list[dict[str, Any]], url: str) -> bool:
    """Paper Fig. 5: accepted and rejected tokens per step vs a static threshold; False if no data."""
    with_sweep = [d for d in datasets if d.get("threshold_sweep")]
    if not with_sweep:
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    for d in with_sweep:
        xs = [p["threshold"] for p in d["threshold_sweep"]]
        line = ax.plot(xs, [p["accepted_per_step"] for p in d["threshold_sweep"]], marker="o",
                       label=f"{d['name']} accepted")[0]
        ax.plot(xs, [p["rejected_per_step"] for p in d["threshold_sweep"]], marker="x", ls="--",
                color=line.get_color(), label=f"{d['name']} rejected")
    ax.set_xlabel("static threshold on Π c'")
    ax.set_ylabel("tokens per decoding step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, url)
    return True


def reliability_plot(rec: RoundRecords, temperatures: list[float], url: str, bins: int = 15) -> None:
    """Per position: observed prefix acceptance vs cumulative confidence, before and after STS."""
    gamma = rec.gamma
    fig, axes = plt.subplots(1, gamma, figsize=(2.6 * gamma, 3.0), squeeze=False)
    raw = np.cumprod(rec.confidences, axis=1)
    cal = np.cumprod(scale(rec.confidences, temperatures), axis=1)
    labels, observed = rec.prefix_accepted(), rec.observed()
    edges = np.linspace(0, 1, bins + 1)
    centers = (edges[:-1] + edges[1:]) / 2
    for k, ax in enumerate(axes[0]):
        rows = observed[:, k]
        hist = ax.twinx()
        hist.hist(cal[rows, k], bins=edges, color="0.85", zorder=0)
        hist.set_yticks([])
        ax.set_zorder(hist.get_zorder() + 1)
        ax.patch.set_visible(False)
        for probs, name in ((raw[rows, k], "raw"), (cal[rows, k], "STS")):
            idx = np.minimum((probs * bins).astype(int), bins - 1)
            ys = [labels[rows, k][idx == b].mean() if (idx == b).any() else np.nan for b in range(bins)]
            ax.plot(centers, ys, marker=".", label=name)
        ax.plot([0, 1], [0, 1], "k--", lw=0.8)
        ax.set_title(f"k={k + 1}, T={temperatures[k]:.2f}", fontsize=9)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        if k == 0:
            ax.set_ylabel("observed prefix acceptance")
            ax.legend(fontsize=7)
        ax.set_xlabel("Π c'", fontsize=8)
    _save(fig, url)


def sps_plot(batch_tokens: list[int], steps_per_second: list[float], url: str, title: str = "") -> None:
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(batch_tokens, steps_per_second, marker="o")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch tokens B")
    ax.set_ylabel("target steps / s")
    ax.set_title(title or "SPS(B)", fontsize=9)
    ax.grid(alpha=0.3)
    _save(fig, url)
