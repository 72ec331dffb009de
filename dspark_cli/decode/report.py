"""Turn decoding statistics into the eval report (JSON, schema `eval_report`) and a rich table."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
from rich import box
from rich.console import Group
from rich.table import Table
from rich.text import Text

from .calibrate import RoundRecords, scale
from .scheduler import threshold_lengths

if TYPE_CHECKING:  # the report is numbers and tables; decoding (torch) need not load for it
    from .specdec import DecodeStats

DEFAULT_THRESHOLDS = [0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9]


def position_acceptance(stats: DecodeStats) -> dict[str, list]:
    """Per slot k: how often it was verified with every earlier slot accepted, and accepted then.

    Conditional acceptance = accepted / reached (None when slot k was never reached).
    """
    reached, accepted = [0] * stats.gamma, [0] * stats.gamma
    for r in stats.rounds:
        for k in range(r.verified):
            if k <= r.accepted:
                reached[k] += 1
            if k < r.accepted:
                accepted[k] += 1
    conditional = [a / n if n else None for a, n in zip(accepted, reached, strict=True)]
    return {"reached": reached, "accepted": accepted, "conditional": conditional}


def tau_from_conditional(conditional: list[float | None], first: float | None = None) -> float:
    """τ that conditional acceptances imply: 1 + Σ_k Π_{j≤k} c_j (a slot never reached counts 0).

    `first` replaces c_1. With first = 1 it is the most a drafter with these later-slot
    acceptances could reach however good its first slot became: the ceiling bench-factors reports.
    """
    tau, reach = 1.0, 1.0
    for k, c in enumerate(conditional):
        reach *= (first if k == 0 and first is not None else c) or 0.0
        tau += reach
    return tau


def accepted_lengths(position: dict[str, list], rounds: int) -> np.ndarray:
    """Accepted draft tokens per round, rebuilt from a report's position counts → int [rounds].

    Slot k is counted accepted in exactly the rounds that accepted more than k tokens, so the
    rounds with j accepted are accepted[j−1] − accepted[j]. Exact when every round verifies all γ
    slots (the fixed schedule); its mean + 1 is the report's τ.
    """
    at_least = [rounds, *position["accepted"], 0]  # rounds with ≥ j accepted, j = 0..γ+1
    counts = [at_least[j] - at_least[j + 1] for j in range(len(at_least) - 1)]
    return np.repeat(np.arange(len(counts)), counts)


def macro_ratio_interval(numerator: list[np.ndarray], denominator: list[np.ndarray],
                         draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of macro τ(numerator) / macro τ(denominator), one array of accepted
    lengths per dataset, resampling rounds. Rounds of one conversation are not independent, so
    the true interval is if anything wider: it says how far one run can be trusted, not more."""
    rng = np.random.default_rng(seed)

    def macro_tau(sets: list[np.ndarray]) -> float:
        return float(np.mean([1.0 + rng.choice(a, a.size).mean() for a in sets]))

    ratios = [macro_tau(numerator) / macro_tau(denominator) for _ in range(draws)]
    low, high = np.percentile(ratios, [2.5, 97.5])
    return float(low), float(high)


def per_conversation(stats: DecodeStats) -> dict[str, list]:
    """Rounds and accepted draft tokens summed per conversation (first-appearance order): what a
    bootstrap over conversations, the unit that is independent, resamples."""
    rounds: dict[str, int] = {}
    accepted: dict[str, int] = {}
    for r in stats.rounds:
        rounds[r.conversation] = rounds.get(r.conversation, 0) + 1
        accepted[r.conversation] = accepted.get(r.conversation, 0) + r.accepted
    ids = list(rounds)
    return {"ids": ids, "rounds": [rounds[i] for i in ids], "accepted": [accepted[i] for i in ids]}


def conversation_ratio_interval(numerator: list[dict[str, list]], denominator: list[dict[str, list]],
                                draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% paired bootstrap interval of macro τ(numerator) / macro τ(denominator).

    One `per_conversation` record per dataset and side. Each draw resamples every dataset's
    conversations with replacement, the same ones for both sides (both drafters decoded the same
    prompts, so pairing removes the prompts' own difficulty from the spread); τ of a resample is
    (Σ accepted + Σ rounds) / Σ rounds, as the report's τ. Conversations only one side decoded are
    dropped.
    """
    rng = np.random.default_rng(seed)
    macro_num, macro_den = np.zeros(draws), np.zeros(draws)
    for num, den in zip(numerator, denominator, strict=True):
        index = {c: i for i, c in enumerate(den["ids"])}
        common = [(i, index[c]) for i, c in enumerate(num["ids"]) if c in index]
        if not common:
            raise ValueError("the two reports share no conversation in one dataset.")
        a, b = (np.array(x) for x in zip(*common, strict=True))
        pick = rng.integers(0, len(common), (draws, len(common)))  # [draws, n]
        macro_num += _resampled_tau(num, a, pick) / len(numerator)
        macro_den += _resampled_tau(den, b, pick) / len(numerator)
    low, high = np.percentile(macro_num / macro_den, [2.5, 97.5])
    return float(low), float(high)


def _resampled_tau(record: dict[str, list], rows: np.ndarray, pick: np.ndarray) -> np.ndarray:
    """τ of each resample [draws]: (Σ accepted + Σ rounds) / Σ rounds of the picked conversations
    (`pick` indexes `rows`, which index the `per_conversation` record), as the report's τ."""
    r = np.asarray(record["rounds"], dtype=np.float64)[rows][pick].sum(axis=1)
    acc = np.asarray(record["accepted"], dtype=np.float64)[rows][pick].sum(axis=1)
    return (acc + r) / np.maximum(r, 1.0)


def tau_interval(record: dict[str, list], draws: int = 2000, seed: int = 0) -> list[float] | None:
    """95% bootstrap interval over conversations of one dataset's τ (a `per_conversation` record).

    Which answers get sampled moves τ far more than the clock moves a round's cost, and a round
    costs about the same in any conversation, so the speed-up moves with τ: this says how far one
    eval's speed-up can be trusted (the demo's 8 conversations: about ±6%). None below two
    conversations.
    """
    n = len(record["ids"])
    if n < 2:
        return None
    pick = np.random.default_rng(seed).integers(0, n, (draws, n))
    low, high = np.percentile(_resampled_tau(record, np.arange(n), pick), [2.5, 97.5])
    return [float(low), float(high)]


def records(stats: DecodeStats) -> RoundRecords | None:
    """Rounds that carry confidences, in the form calibration and the sweep read."""
    rows = [r for r in stats.rounds if r.confidences is not None]
    if not rows:
        return None
    return RoundRecords.from_lists([r.confidences for r in rows], [r.verified for r in rows],
                                   [r.accepted for r in rows], [r.conversation for r in rows])


def threshold_sweep(stats: DecodeStats, thresholds: list[float],
                    temperatures: list[float] | None = None) -> list[dict[str, Any]]:
    """Paper Fig. 5: verify while the (calibrated) prefix survival ≥ t; count per decoding step.

    Counterfactual from the recorded rounds: a slot's acceptance does not depend on how many slots
    are verified, so a shorter verification accepts min(ℓ_t, a) tokens; ℓ_t is capped by the ℓ
    actually verified (exact with the fixed schedule).
    """
    rec = records(stats)
    if rec is None:
        return []
    conf = scale(rec.confidences, temperatures) if temperatures else rec.confidences
    out = []
    for t in thresholds:
        lengths = np.array(threshold_lengths(conf.tolist(), t, rec.verified.tolist()))
        acc = np.minimum(lengths, rec.accepted)
        verified = lengths.sum()
        out.append({"threshold": t, "accepted_per_step": float(acc.mean()),
                    "rejected_per_step": float((lengths - acc).mean()),
                    "acceptance_rate": float(acc.sum() / verified) if verified else None})
    return out


def scheduler_summary(stats: DecodeStats, policy: str, concurrency: int) -> dict[str, Any]:
    """Per round: tokens verified, τ per request, modelled Θ, measured tokens/s, budget (Fig. 8)."""
    batches = stats.batches
    n = max(len(batches), 1)
    request_rounds = sum(b.requests for b in batches) or 1
    return {
        "policy": policy,
        "concurrency": concurrency,
        "rounds": len(batches),
        "verified_per_round": sum(b.batch_tokens for b in batches) / n,
        "tau_per_request": sum(b.emitted for b in batches) / request_rounds,
        "theta": sum(b.theta for b in batches) / n,
        "budget_per_request": sum(b.batch_tokens - b.requests for b in batches) / request_rounds,
        "tokens_per_second": stats.new_tokens / stats.seconds if stats.seconds > 0 else None,
    }


def round_phases(stats: DecodeStats) -> dict[str, float]:
    """Seconds per joint round of each phase the loop times (specdec's module doc names them)."""
    rounds = max(len(stats.batches), 1)
    p = stats.phases
    parts = {k: p.get(k, 0.0) / rounds for k in ("draft_backbone", "draft_heads", "draft_context", "verify",
                                                 "prefill")}
    parts["draft"] = parts["draft_backbone"] + parts["draft_heads"] + parts["draft_context"]
    parts["outside"] = (p.get("schedule", 0.0) + p.get("accept", 0.0)) / rounds
    return parts


def round_cost(stats: DecodeStats, baseline: DecodeStats | None) -> dict[str, Any] | None:
    """A round's wall time in target-only steps, split by phase: why a speed-up is what it is.

    With t₁ the baseline's seconds per token, speed-up = tokens per round / cost exactly, so the
    cost is also the break-even τ. `other` is what no phase timer covers (Python between laps).
    """
    rounds = len(stats.batches)
    if not rounds or stats.seconds <= 0 or not baseline or min(baseline.new_tokens, baseline.seconds) <= 0:
        return None
    t1 = baseline.seconds / baseline.new_tokens
    cost = stats.seconds / rounds / t1
    ph = round_phases(stats)
    parts = {"draft": ph["draft"] / t1, "verify": ph["verify"] / t1, "prefill": ph["prefill"] / t1,
             "outside": ph["outside"] / t1}
    parts["other"] = cost - sum(parts.values())
    return {"target_step_ms": 1000 * t1, "tokens_per_round": stats.new_tokens / rounds,
            "cost_in_target_steps": cost, "parts": parts,
            "c": ph["draft"] / ph["verify"] if ph["verify"] > 0 else None}


def dataset_report(name: str, url: str, conversations: int, stats: DecodeStats,
                   baseline: DecodeStats | None, policy: str, concurrency: int,
                   thresholds: list[float], temperatures: list[float] | None,
                   sweep: list[dict[str, Any]] | None = None,
                   timing: str = "sequential") -> dict[str, Any]:
    """One dataset's report; `timing` says how the two loops' clocks relate (specdec.paired_decode)."""
    rounds = len(stats.rounds)
    conversation_sums = per_conversation(stats)
    accepted = sum(r.accepted for r in stats.rounds)
    verified = sum(r.verified for r in stats.rounds)
    spec_tps = stats.new_tokens / stats.seconds if stats.seconds > 0 else None
    base_tps = baseline.new_tokens / baseline.seconds if baseline and baseline.seconds > 0 else None
    return {
        "name": name,
        "url": url,
        "conversations": conversations,
        "turns": stats.turns,
        "rounds": rounds,
        "new_tokens": stats.new_tokens,
        # τ as the paper reports it: tokens per round, the correction/bonus token included.
        "tau": (accepted + rounds) / rounds if rounds else None,
        "drafted": rounds * stats.gamma,
        "verified": verified,
        "accepted": accepted,
        "acceptance_rate": accepted / verified if verified else None,
        "position_acceptance": position_acceptance(stats),
        "per_conversation": conversation_sums,
        "tau_interval": tau_interval(conversation_sums),  # 95%, bootstrap over conversations
        "tokens_per_second": {"speculative": spec_tps, "target_only": base_tps,
                              "speedup": spec_tps / base_tps if spec_tps and base_tps else None,
                              "speculative_seconds": stats.seconds,
                              "target_only_seconds": baseline.seconds if baseline else None,
                              "target_only_tokens": baseline.new_tokens if baseline else None,
                              "timing": timing if baseline else None},
        "round_cost": round_cost(stats, baseline),
        "scheduler": [scheduler_summary(stats, policy, concurrency), *(sweep or [])],
        "threshold_sweep": threshold_sweep(stats, thresholds, temperatures),
    }


#: Eval table columns; numbers never cut their header (only a long dataset name folds).
EVAL_COLUMNS = ("dataset", "τ", "accept", "drafted", "verified", "accepted", "tok/s\nspec", "tok/s\ntarget",
                "speedup")


def _header_width(col: str) -> int:
    return max(len(part) for part in col.split("\n"))


def render_table(report: dict[str, Any]) -> Group:
    """The eval summary: one row per dataset (fits 80 columns), then each dataset's conditional
    acceptance by position on its own line (a list as long as γ does not fit a cell)."""
    table = Table(title=f"dspark eval — γ={report['block_size']}, T={report['temperature']}, "
                        f"schedule={report['schedule']}",
                  box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    for col in EVAL_COLUMNS:
        if col == "dataset":
            table.add_column(col, justify="left", overflow="fold")
        else:
            table.add_column(col, justify="right", no_wrap=True, min_width=_header_width(col))

    def f(x: float | None, digits: int = 2) -> str:
        return "—" if x is None else f"{x:.{digits}f}"

    lines = []
    for d in report["datasets"]:
        tps = d["tokens_per_second"]
        table.add_row(d["name"], f(d["tau"]), f(d["acceptance_rate"]), str(d["drafted"]), str(d["verified"]),
                      str(d["accepted"]), f(tps["speculative"], 1), f(tps["target_only"], 1),
                      f(tps["speedup"]))
        cond = " ".join(f(c) for c in d["position_acceptance"]["conditional"])
        lines.append(Text(f"{d['name']}: conditional acceptance by position {cond}"))
        if d.get("round_cost"):  # reports written before it lack it
            lines.append(Text(f"{d['name']}: {cost_line(d['round_cost'])}"))
        if d.get("tau_interval"):
            cost = (d.get("round_cost") or {}).get("cost_in_target_steps")
            lines.append(Text(f"{d['name']}: {interval_line(d['tau_interval'], d['conversations'], cost)}"))
    return Group(table, *lines)


def interval_line(tau_range: list[float], conversations: int, round_cost_steps: float | None) -> str:
    """'τ 1.56–1.77 (95% over 8 conversations): speed-up 1.03–1.17× at this round cost'."""
    low, high = tau_range
    line = f"τ {low:.2f}–{high:.2f} (95% over {conversations} conversations)"
    cost = round_cost_steps
    if cost:
        line += f": speed-up {low / cost:.2f}–{high / cost:.2f}× at this round cost"
    return line


def cost_line(cost: dict[str, Any]) -> str:
    """'a round costs 1.45 target steps (draft 0.21 · verify 1.10 · …) for 1.52 tokens: 1.05×'."""
    parts = " · ".join(f"{k} {v:.2f}" for k, v in cost["parts"].items())
    speedup = cost["tokens_per_round"] / cost["cost_in_target_steps"]
    return (f"a round costs {cost['cost_in_target_steps']:.2f} target steps ({parts}; one step "
            f"{cost['target_step_ms']:.1f} ms) for {cost['tokens_per_round']:.2f} tokens: {speedup:.2f}×; "
            f"break-even at {cost['cost_in_target_steps']:.2f} tokens a round")


def render_scheduler_table(report: dict[str, Any]) -> Table | None:
    """Per dataset and R: tokens verified per round, τ per request, Θ, budget per request (Fig. 8)."""
    rows = [(d["name"], s) for d in report["datasets"] for s in d["scheduler"]]
    if report["schedule"] == "fixed" and len(rows) == len(report["datasets"]) and report["concurrency"] == 1:
        return None
    sps = f", SPS {report['sps']}" if report["sps"] else ""
    table = Table(title=f"scheduler: {report['schedule']}{sps}")
    for col in ("dataset", "R", "rounds", "verified/round", "τ/request", "Θ = τ·SPS(B)", "tok/s measured",
                "budget/request"):
        table.add_column(col, justify="left" if col == "dataset" else "right")
    for name, s in rows:
        measured = s.get("tokens_per_second")  # reports before measured throughput lack it
        table.add_row(name, str(s["concurrency"]), str(s["rounds"]), f"{s['verified_per_round']:.2f}",
                      f"{s['tau_per_request']:.2f}", f"{s['theta']:.2f}",
                      "—" if measured is None else f"{measured:.1f}", f"{s['budget_per_request']:.2f}")
    return table
