"""Sequential Temperature Scaling (STS) and the calibration metrics it is judged by.

Inputs are per-round records: the raw confidence of each of the γ slots, how many slots were
verified (ℓ) and how many accepted (a). Prefix acceptance at slot k (0-based) is `k < a`; it is
observed when the slot was verified (k < ℓ) or an earlier rejection already decided it (a < ℓ).
STS fits T_1..T_γ left to right: T_k minimises the ECE of Π_{i≤k} σ(logit(c_i)/T_i) against
prefix acceptance, the earlier temperatures fixed (DESIGN.md §4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EPS = 1e-6


@dataclass
class RoundRecords:
    """N rounds of one drafter: raw confidences [N, γ], verified ℓ [N], accepted a [N]."""

    confidences: np.ndarray
    verified: np.ndarray
    accepted: np.ndarray

    @classmethod
    def from_lists(cls, confidences: list[list[float]], verified: list[int],
                   accepted: list[int]) -> RoundRecords:
        conf = np.asarray(confidences, dtype=np.float64).reshape(len(confidences), -1)  # [N, γ]
        return cls(conf, np.asarray(verified, dtype=np.int64), np.asarray(accepted, dtype=np.int64))

    @property
    def gamma(self) -> int:
        return self.confidences.shape[1]

    def prefix_accepted(self) -> np.ndarray:
        """[N, γ] bool: slots 0..k were all accepted."""
        k = np.arange(self.gamma)[None, :]
        return k < self.accepted[:, None]

    def observed(self) -> np.ndarray:
        """[N, γ] bool: whether prefix acceptance at slot k is known for that round."""
        k = np.arange(self.gamma)[None, :]
        return (k < self.verified[:, None]) | (self.accepted[:, None] < self.verified[:, None])


def logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, EPS, 1 - EPS)
    return np.log(p) - np.log1p(-p)


def scale(confidences: np.ndarray, temperatures: np.ndarray | list[float]) -> np.ndarray:
    """c'_k = σ(logit(c_k) / T_k), per slot (last axis)."""
    t = np.asarray(temperatures, dtype=np.float64)
    return 1.0 / (1.0 + np.exp(-logit(np.asarray(confidences, dtype=np.float64)) / t))


def apply_temperatures(confidences: list[float], temperatures: list[float]) -> list[float]:
    """Calibrate one round's slot confidences (what eval does before scheduling)."""
    if len(confidences) != len(temperatures):
        raise ValueError(f"{len(confidences)} confidences but {len(temperatures)} temperatures.")
    return scale(np.asarray(confidences), temperatures).tolist()


def ece(probs: np.ndarray, labels: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error with equal-width bins: Σ_b (n_b/N)·|mean label − mean prob|."""
    probs, labels = np.asarray(probs, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    if probs.size == 0:
        return float("nan")
    idx = np.minimum((probs * bins).astype(np.int64), bins - 1)
    total = 0.0
    for b in range(bins):
        sel = idx == b
        if sel.any():
            total += sel.sum() * abs(labels[sel].mean() - probs[sel].mean())
    return float(total / probs.size)


def brier(probs: np.ndarray, labels: np.ndarray) -> float:
    probs, labels = np.asarray(probs, dtype=np.float64), np.asarray(labels, dtype=np.float64)
    return float(np.mean((probs - labels) ** 2)) if probs.size else float("nan")


def roc_auc(scores: np.ndarray, labels: np.ndarray) -> float | None:
    """Area under the ROC curve (Mann–Whitney, ties count half); None when one class is missing."""
    scores, labels = np.asarray(scores, dtype=np.float64), np.asarray(labels).astype(bool)
    pos, neg = int(labels.sum()), int((~labels).sum())
    if pos == 0 or neg == 0:
        return None
    order = np.argsort(scores, kind="mergesort")
    ranks = np.empty(len(scores), dtype=np.float64)
    sorted_scores = scores[order]
    i = 0
    while i < len(scores):  # average ranks over ties
        j = i
        while j + 1 < len(scores) and sorted_scores[j + 1] == sorted_scores[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return float((ranks[labels].sum() - pos * (pos + 1) / 2) / (pos * neg))


def temperature_grid(t_min: float, t_max: float, steps: int) -> np.ndarray:
    """Geometric grid (temperatures act multiplicatively on logits), with 1.0 always included."""
    grid = np.geomspace(t_min, t_max, max(steps, 2))
    return np.unique(np.append(grid, 1.0) if t_min <= 1.0 <= t_max else grid)


@dataclass
class StsFit:
    temperatures: list[float]
    per_position: list[dict]
    ece_before: float
    ece_after: float
    num_samples: int


def _position_metrics(k: int, raw_cum: np.ndarray, cal_cum: np.ndarray, labels: np.ndarray,
                      temperature: float, bins: int) -> dict:
    return {
        "position": k + 1,
        "temperature": temperature,
        "samples": int(labels.size),
        "prefix_acceptance": float(labels.mean()) if labels.size else None,
        "ece_before": ece(raw_cum, labels, bins),
        "ece_after": ece(cal_cum, labels, bins),
        "brier_before": brier(raw_cum, labels),
        "brier_after": brier(cal_cum, labels),
        "roc_auc_before": roc_auc(raw_cum, labels),
        "roc_auc_after": roc_auc(cal_cum, labels),
    }


def fit_sts(records: RoundRecords, t_min: float = 0.05, t_max: float = 10.0, t_steps: int = 200,
            bins: int = 15) -> StsFit:
    """Grid-search T_k left to right on the cumulative product's ECE (earlier T_i fixed)."""
    grid = temperature_grid(t_min, t_max, t_steps)
    labels_all, observed = records.prefix_accepted(), records.observed()
    raw_cum = np.cumprod(records.confidences, axis=1)  # [N, γ]
    logits = logit(records.confidences)
    cal_prefix = np.ones(len(records.confidences))  # Π_{i<k} c'_i with the temperatures chosen so far
    temps, per_position = [], []
    for k in range(records.gamma):
        rows = observed[:, k]
        labels = labels_all[rows, k]
        # [G, n]: candidate cumulative products for every grid temperature at once.
        cand = cal_prefix[rows][None, :] / (1.0 + np.exp(-logits[rows, k][None, :] / grid[:, None]))
        errors = [ece(c, labels, bins) for c in cand] if labels.size else [0.0] * len(grid)
        best = int(np.nanargmin(errors)) if labels.size else int(np.argmin(np.abs(grid - 1.0)))
        t_k = float(grid[best])
        temps.append(t_k)
        cal_prefix = cal_prefix / (1.0 + np.exp(-logits[:, k] / t_k))
        per_position.append(_position_metrics(k, raw_cum[rows, k], cal_prefix[rows], labels, t_k, bins))
    weights = np.array([p["samples"] for p in per_position], dtype=np.float64)

    def mean(key: str) -> float:
        vals = np.array([p[key] if p[key] == p[key] else 0.0 for p in per_position])
        return float((vals * weights).sum() / weights.sum()) if weights.sum() else float("nan")

    return StsFit(temps, per_position, mean("ece_before"), mean("ece_after"), len(records.confidences))
