"""Sequential Temperature Scaling (STS), the calibration metrics it is judged by, and its file.

Inputs are per-round records: the raw confidence of each of the γ slots, how many slots were
verified (ℓ) and how many accepted (a). Prefix acceptance at slot k (0-based) is `k < a`; it is
observed when the slot was verified (k < ℓ) or an earlier rejection already decided it (a < ℓ).
STS fits T_1..T_γ left to right: T_k minimises the ECE of Π_{i≤k} σ(logit(c_i)/T_i) against
prefix acceptance, the earlier temperatures fixed (DESIGN.md §4).

A fit is only as good as the rounds behind it, so:
- a position is fitted only when its observed prefixes hold at least `min_prefixes` accepted and
  as many rejected ones; otherwise (and when the best T lies on the grid's edge, i.e. the ECE
  kept falling toward a degenerate 0/1 confidence) it keeps T = 1, the head as trained;
- the fit ships only when it also helps on conversations it was not fitted on: the search is
  cross-fitted over halves of its own conversations, and unless each half's fit lowers the other
  half's pooled ECE every T is 1 (`no_held_out_gain`). An ECE grid search on a few hundred rounds
  otherwise ships temperatures that fit bin noise: the demo's T_1 = 0.91 raised the
  out-of-sample pooled ECE from 0.76% to 1.10%;
- the ECE that leads is out of sample: the conversations are split in two folds, STS is fitted on
  one and scored on the other, both ways round (`cross_fit`). The shipped temperatures are then
  fitted on all rounds, so the figure describes the procedure, on data of half the size.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

EPS = 1e-6
#: Default for `calibrate.min_prefixes` (docs/eval.md shows the measurement behind it).
MIN_PREFIXES = 30
FITTED, TOO_FEW, BOUNDARY, NO_GAIN = "fitted", "too_few_prefixes", "grid_boundary", "no_held_out_gain"


@dataclass
class RoundRecords:
    """N rounds of one drafter: raw confidences [N, γ], verified ℓ [N], accepted a [N], and the
    conversation each round belongs to [N] (None: unknown; cross-fitting then splits by order)."""

    confidences: np.ndarray
    verified: np.ndarray
    accepted: np.ndarray
    groups: np.ndarray | None = None

    @classmethod
    def from_lists(cls, confidences: list[list[float]], verified: list[int],
                   accepted: list[int], groups: list[str] | None = None) -> RoundRecords:
        conf = np.asarray(confidences, dtype=np.float64).reshape(len(confidences), -1)  # [N, γ]
        return cls(conf, np.asarray(verified, dtype=np.int64), np.asarray(accepted, dtype=np.int64),
                   None if groups is None else np.asarray(groups, dtype=object))

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

    def subset(self, rows: np.ndarray) -> RoundRecords:
        return RoundRecords(self.confidences[rows], self.verified[rows], self.accepted[rows],
                            None if self.groups is None else self.groups[rows])

    def folds(self) -> tuple[np.ndarray, np.ndarray]:
        """Two boolean row masks: conversations alternately in order of appearance (rounds of one
        conversation are alike, so splitting inside one would leak); by halves without groups."""
        n = len(self.confidences)
        if self.groups is None:
            first = np.arange(n) < n // 2
        else:
            order = {g: i for i, g in enumerate(dict.fromkeys(self.groups.tolist()))}
            first = np.array([order[g] % 2 == 0 for g in self.groups.tolist()], dtype=bool)
        return first, ~first


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
    return float(ece_rows(probs[None, :], labels, bins)[0])


def ece_rows(probs: np.ndarray, labels: np.ndarray, bins: int = 15) -> np.ndarray:
    """ECE of each row of probs [G, n] against the same labels [n] → [G] (one pass for a grid).

    n_b·|mean label − mean prob| = |Σ_b label − Σ_b prob|, so per-bin sums are all it needs.
    """
    G, n = probs.shape
    idx = np.minimum((probs * bins).astype(np.int64), bins - 1) + bins * np.arange(G)[:, None]
    sum_p = np.bincount(idx.ravel(), probs.ravel(), minlength=G * bins)
    sum_l = np.bincount(idx.ravel(), np.broadcast_to(labels, probs.shape).ravel(), minlength=G * bins)
    return np.abs(sum_l - sum_p).reshape(G, bins).sum(axis=1) / n


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


# ---- fitting -----------------------------------------------------------------------------------

@dataclass
class StsFit:
    """Temperatures, why each is what it is (`status`), and in-sample metrics per position."""

    temperatures: list[float]
    status: list[str]  # per position: fitted | too_few_prefixes | grid_boundary | no_held_out_gain
    per_position: list[dict]
    ece_before: float  # pooled, in sample
    ece_after: float
    num_samples: int

    @property
    def fitted(self) -> list[bool]:
        return [s == FITTED for s in self.status]


def _best_temperature(errors: np.ndarray, grid: np.ndarray) -> int:
    """Index of the lowest ECE; among ties (ECE is flat between bin crossings) the T nearest 1."""
    best = np.nanmin(errors)
    ties = np.flatnonzero(errors <= best + 1e-12)
    return int(ties[np.argmin(np.abs(np.log(grid[ties])))])


def _fit_position(logits_k: np.ndarray, labels: np.ndarray, prefix: np.ndarray, grid: np.ndarray,
                  bins: int, min_prefixes: int) -> tuple[float, str]:
    """T_k for one position's observed rounds (their logits, labels and fixed Π_{i<k} c'_i)."""
    if min(int(labels.sum()), int((~labels).sum())) < max(min_prefixes, 1):
        return 1.0, TOO_FEW
    # [G, n]: candidate cumulative products for every grid temperature at once.
    cand = prefix[None, :] / (1.0 + np.exp(-logits_k[None, :] / grid[:, None]))
    best = _best_temperature(ece_rows(cand, labels.astype(np.float64), bins), grid)
    return (float(grid[best]), FITTED) if 0 < best < len(grid) - 1 else (1.0, BOUNDARY)


def fit_temperatures(records: RoundRecords, t_min: float = 0.05, t_max: float = 10.0, t_steps: int = 200,
                     bins: int = 15, min_prefixes: int = MIN_PREFIXES,
                     held_out_check: bool = True) -> tuple[list[float], list[str]]:
    """Grid-search T_k left to right on the cumulative product's ECE (earlier T_i fixed).

    With `held_out_check`, the same search is cross-fitted over the halves of these conversations
    first: unless each half's fit lowers the other half's pooled ECE, every T stays 1
    (`no_held_out_gain`).
    The check is global, not per position, because T_k is fitted on top of T_<k: undoing one
    position would leave the later ones fitted for a prefix that no longer ships."""
    grid = temperature_grid(t_min, t_max, t_steps)
    labels_all, observed = records.prefix_accepted(), records.observed()
    logits = logit(records.confidences)
    cal_prefix = np.ones(len(records.confidences))  # Π_{i<k} c'_i with the temperatures chosen so far
    temps, status = [], []
    for k in range(records.gamma):
        rows = observed[:, k]
        t_k, why = _fit_position(logits[rows, k], labels_all[rows, k], cal_prefix[rows], grid, bins,
                                 min_prefixes)
        temps.append(t_k)
        status.append(why)
        cal_prefix = cal_prefix / (1.0 + np.exp(-logits[:, k] / t_k))
    if held_out_check and FITTED in status:
        halves = cross_fit(records, t_min, t_max, t_steps, bins, min_prefixes, held_out_check=False)
        if halves is not None and not halves.helps_both_ways:
            temps, status = [1.0] * records.gamma, [NO_GAIN if s == FITTED else s for s in status]
    return temps, status


def position_ece(records: RoundRecords, temperatures: list[float] | None,
                 bins: int = 15) -> tuple[np.ndarray, np.ndarray]:
    """Per position: ECE of the (scaled) cumulative product over its observed rounds, and their count."""
    conf = records.confidences if temperatures is None else scale(records.confidences, temperatures)
    cumulative = np.cumprod(conf, axis=1)
    labels, observed = records.prefix_accepted(), records.observed()
    errors = np.array([ece(cumulative[observed[:, k], k], labels[observed[:, k], k], bins)
                       for k in range(records.gamma)])
    return errors, observed.sum(axis=0)


def pooled(errors: np.ndarray, counts: np.ndarray) -> float:
    """Round-weighted mean over positions (a position without rounds weighs nothing)."""
    w = np.asarray(counts, dtype=np.float64)
    vals = np.nan_to_num(np.asarray(errors, dtype=np.float64))
    return float((vals * w).sum() / w.sum()) if w.sum() else float("nan")


def _position_metrics(k: int, raw_cum: np.ndarray, cal_cum: np.ndarray, labels: np.ndarray,
                      temperature: float, status: str, bins: int) -> dict:
    return {
        "position": k + 1,
        "temperature": temperature,
        "fitted": status == FITTED,
        "status": status,
        "samples": int(labels.size),
        "accepted_prefixes": int(labels.sum()),
        "prefix_acceptance": float(labels.mean()) if labels.size else None,
        "ece_before": ece(raw_cum, labels, bins),
        "ece_after": ece(cal_cum, labels, bins),
        "brier_before": brier(raw_cum, labels),
        "brier_after": brier(cal_cum, labels),
        "roc_auc_before": roc_auc(raw_cum, labels),
        "roc_auc_after": roc_auc(cal_cum, labels),
    }


def fit_sts(records: RoundRecords, t_min: float = 0.05, t_max: float = 10.0, t_steps: int = 200,
            bins: int = 15, min_prefixes: int = MIN_PREFIXES, held_out_check: bool = True) -> StsFit:
    """Fit on all of `records` and score in sample (see `cross_fit` for the honest figure)."""
    temps, status = fit_temperatures(records, t_min, t_max, t_steps, bins, min_prefixes, held_out_check)
    labels_all, observed = records.prefix_accepted(), records.observed()
    raw_cum = np.cumprod(records.confidences, axis=1)
    cal_cum = np.cumprod(scale(records.confidences, temps), axis=1)
    per_position = []
    for k in range(records.gamma):
        rows = observed[:, k]
        per_position.append(_position_metrics(k, raw_cum[rows, k], cal_cum[rows, k], labels_all[rows, k],
                                              temps[k], status[k], bins))
    counts = np.array([p["samples"] for p in per_position])
    before = pooled(np.array([p["ece_before"] for p in per_position], dtype=np.float64), counts)
    after = pooled(np.array([p["ece_after"] for p in per_position], dtype=np.float64), counts)
    return StsFit(temps, status, per_position, before, after, len(records.confidences))


@dataclass
class CrossFit:
    """Out-of-sample ECE: each fold scored with the temperatures fitted on the other."""

    ece_before: list[float]  # per position, raw confidences, on the same held-out folds
    ece_after: list[float]
    samples: list[int]
    pooled_before: float
    pooled_after: float
    fold_temperatures: list[list[float]]
    fold_rounds: list[int]
    fold_conversations: list[int]
    #: Per direction (B's rounds with A's fit, then A's with B's): the scored fold's pooled ECE.
    fold_pooled_before: list[float]
    fold_pooled_after: list[float]

    @property
    def helps_both_ways(self) -> bool:
        """Each fold's fit lowers the other fold's pooled ECE: a gain seen one way only is bin
        noise as often as not (bench-quality's drafter: one fold's temperatures raised the
        other's ECE, 1.37% → 1.53% pooled)."""
        return all(a < b for a, b in zip(self.fold_pooled_after, self.fold_pooled_before, strict=True))


def cross_fit(records: RoundRecords, t_min: float = 0.05, t_max: float = 10.0, t_steps: int = 200,
              bins: int = 15, min_prefixes: int = MIN_PREFIXES, held_out_check: bool = True
              ) -> CrossFit | None:
    """Fit on fold A and score B, fit on B and score A; per position the fold ECEs are averaged,
    weighted by their rounds. None when one fold is empty (a single conversation). The fit on a
    fold runs the whole procedure, its own held-out check inside that fold included, so the
    figure scores the procedure that produced the shipped temperatures."""
    masks = records.folds()
    if not all(m.any() for m in masks):
        return None
    parts = [records.subset(m) for m in masks]
    fold_temps, raw_err, cal_err, counts = [], [], [], []
    for fit_on, score_on in ((parts[0], parts[1]), (parts[1], parts[0])):
        temps, _ = fit_temperatures(fit_on, t_min, t_max, t_steps, bins, min_prefixes, held_out_check)
        fold_temps.append(temps)
        raw, n = position_ece(score_on, None, bins)
        cal, _ = position_ece(score_on, temps, bins)
        raw_err.append(np.nan_to_num(raw))
        cal_err.append(np.nan_to_num(cal))
        counts.append(n)
    n = counts[0] + counts[1]
    weight = np.divide(np.stack(counts), n, out=np.zeros((2, len(n))), where=n > 0)
    before = (weight * np.stack(raw_err)).sum(axis=0)
    after = (weight * np.stack(cal_err)).sum(axis=0)
    convs = [len(set(p.groups.tolist())) if p.groups is not None else 0 for p in parts]
    return CrossFit(before.tolist(), after.tolist(), n.tolist(), pooled(before, n), pooled(after, n),
                    fold_temps, [len(p.confidences) for p in parts], convs,
                    [pooled(e, c) for e, c in zip(raw_err, counts, strict=True)],
                    [pooled(e, c) for e, c in zip(cal_err, counts, strict=True)])


# ---- the file ----------------------------------------------------------------------------------

SCHEMA_VERSION = 2


def calibration_file(fit: StsFit, cross: CrossFit | None, *, dataset: str, extra: dict) -> dict:
    """calibration.json: SGLang's STS keys first (DESIGN.md §3; per-position lists of floats,
    out of sample when a cross-fit exists), then ours (`pooled_*`, `in_sample`, `cross_fit`…)."""
    in_before = [_float(p["ece_before"]) for p in fit.per_position]
    in_after = [_float(p["ece_after"]) for p in fit.per_position]
    out_of_sample = cross is not None
    before = cross.ece_before if cross else in_before
    after = cross.ece_after if cross else in_after
    pooled_after = cross.pooled_after if cross else fit.ece_after
    if cross and all(t == 1.0 for t in fit.temperatures):
        # What ships is the raw head, fitted on nothing: its out-of-sample ECE is the raw one. The
        # cross-fit's "after" scored the procedure, whose folds may still have fitted; kept below.
        after, pooled_after = list(cross.ece_before), cross.pooled_before
    return {
        "temperatures": [float(t) for t in fit.temperatures],
        "dataset": dataset,
        "num_samples": int(fit.num_samples),
        "ece_before": [float(e) for e in before],
        "ece_after": [float(e) for e in after],
        "schema_version": SCHEMA_VERSION,
        "ece_source": "cross_fit" if out_of_sample else "in_sample",
        "pooled_ece_before": cross.pooled_before if cross else fit.ece_before,
        "pooled_ece_after": pooled_after,
        "fitted": fit.fitted,
        "in_sample": {"pooled_ece_before": fit.ece_before, "pooled_ece_after": fit.ece_after,
                      "ece_before": in_before, "ece_after": in_after},
        "cross_fit": None if cross is None else {
            "folds": 2, "split": "conversations, alternately", "rounds": cross.fold_rounds,
            "conversations": cross.fold_conversations, "temperatures": cross.fold_temperatures,
            "samples": cross.samples, "procedure_ece_after": cross.ece_after,
            "procedure_pooled_ece_after": cross.pooled_after,
            # per direction (fold B scored with A's fit, then A with B's): which one a fit failed
            "fold_pooled_ece_before": [_float(e) for e in cross.fold_pooled_before],
            "fold_pooled_ece_after": [_float(e) for e in cross.fold_pooled_after]},
        **extra,
        "per_position": fit.per_position,
    }


def _float(x: float | None) -> float:
    """A position without observed rounds has no ECE; SGLang's lists take floats only, so 0.0."""
    return 0.0 if x is None or x != x else float(x)


def summary(obj: dict) -> dict:
    """Pooled ECE before/after and whether it is out of sample, for this release's files (v2),
    the previous one's (v1: `ece_before`/`ece_after` were pooled in-sample numbers) and a bare
    SGLang-form file (per-position lists only: their plain mean, provenance unknown)."""
    gamma = len(obj["temperatures"])
    if isinstance(obj.get("ece_before"), int | float):
        return {"ece_before": float(obj["ece_before"]), "ece_after": float(obj["ece_after"]),
                "out_of_sample": False, "in_sample_after": float(obj["ece_after"]), "fitted": [True] * gamma}

    def mean(values: list) -> float | None:
        return sum(values) / len(values) if values else None

    before = obj.get("pooled_ece_before", mean(obj["ece_before"]))
    after = obj.get("pooled_ece_after", mean(obj["ece_after"]))
    return {"ece_before": before, "ece_after": after, "out_of_sample": obj.get("ece_source") == "cross_fit",
            "in_sample_after": (obj.get("in_sample") or {}).get("pooled_ece_after", after),
            "fitted": obj.get("fitted", [True] * gamma)}
