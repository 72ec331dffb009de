"""Can a calibration family with an offset do what STS's temperatures cannot? (after bench-quality)

    .venv/bin/python -m benchmarks.bench_calibration      # make bench-calibration

STS rescales each slot's confidence logit by 1/T_k, so a confidence of 0.5 stays 0.5 whatever T_k
is. When the head is off in the middle (it says 0.5, a third of those slots are accepted), STS has
nothing to fit. This benchmark re-decodes the calibration prompts exactly as `dspark calibrate`
does (same drafter, prompts, seed and full verification), then compares, on the same rounds:

- STS (the shipped fit, `decode/calibrate.fit_sts`), and
- per-position Platt scaling, c'_k = σ(a_k·logit(c_k) + b_k), fitted like STS: left to right,
  each (a_k, b_k) minimising the ECE of the cumulative product Π_{i≤k} c'_i, on a grid.

Both are scored in-sample (what calibration.json reports) and cross-fitted: fit on one half of
the rounds, score the other half, both ways round. The halves have half the rounds, so their ECE
floor is higher: the `floor` lines give the pooled ECE a perfectly calibrated head scores at the
full and the half count (bin noise alone). Platt is measured here only; the calibrate stage
still fits STS (DESIGN.md §4).

    .venv/bin/python benchmarks/bench_calibration.py --threshold-study

measures, on synthetic rounds, how many accepted (and rejected) prefixes a position needs before
its fitted T helps more often than it hurts: the evidence behind `calibrate.min_prefixes`;
`--held-out-check-study` compares STS with and without its held-out check, cross-fitted.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from dspark_cli.decode.calibrate import (
    BOUNDARY,
    RoundRecords,
    cross_fit,
    ece,
    fit_sts,
    fit_temperatures,
    logit,
    scale,
)

SLOPES = np.geomspace(0.1, 10.0, 41)
OFFSETS = np.linspace(-3.0, 3.0, 61)


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def decode_rounds(config: str, work: str, drafter: str) -> RoundRecords:
    """The calibrate stage's rounds (its prompts and decoding), without its fit."""
    from dspark_cli.config import load_config
    from dspark_cli.decode.prompts import load_conversations
    from dspark_cli.decode.stages import calibration_rounds, load_models
    from dspark_cli.pipeline import stage_output

    cfg = load_config(config, [f"pipeline.work_dir={work}"], extra={})
    convs = load_conversations(stage_output(cfg, "prepare"), cfg.calibrate.num_prompts, cfg.calibrate.split)
    model, tokenizer, model_drafter = load_models(cfg, cfg.target.model, drafter)
    rec = calibration_rounds(cfg, model, tokenizer, model_drafter, convs)
    if rec is None:
        sys.exit(f"{drafter}: no rounds with confidences (does the drafter have a confidence head?)")
    return rec


def pooled_ece(rec: RoundRecords, calibrated: np.ndarray, bins: int = 15) -> tuple[float, np.ndarray]:
    """The calibrate stage's figure: per-position ECE of the cumulative product, round-weighted."""
    labels, observed = rec.prefix_accepted(), rec.observed()
    cumulative = np.cumprod(calibrated, axis=1)
    per, weights = [], []
    for k in range(rec.gamma):
        rows = observed[:, k]
        per.append(ece(cumulative[rows, k], labels[rows, k], bins) if rows.any() else 0.0)
        weights.append(rows.sum())
    per_a, w = np.array(per), np.array(weights, dtype=np.float64)
    return float((per_a * w).sum() / w.sum()), per_a


def fit_platt(rec: RoundRecords, bins: int = 15) -> list[tuple[float, float]]:
    """(a_k, b_k) left to right, each minimising the cumulative product's ECE (earlier ones fixed)."""
    labels_all, observed = rec.prefix_accepted(), rec.observed()
    logits = logit(rec.confidences)
    prefix = np.ones(len(logits))
    params: list[tuple[float, float]] = []
    for k in range(rec.gamma):
        rows = observed[:, k]
        labels = labels_all[rows, k]
        best, chosen = np.inf, (1.0, 0.0)
        for a in SLOPES:
            candidates = sigmoid(a * logits[rows, k][None, :] + OFFSETS[:, None])
            for j, b in enumerate(OFFSETS):
                err = ece(prefix[rows] * candidates[j], labels, bins) if labels.size else 0.0
                if err < best:
                    best, chosen = err, (float(a), float(b))
        params.append(chosen)
        prefix = prefix * sigmoid(chosen[0] * logits[:, k] + chosen[1])
    return params


def apply_platt(confidences: np.ndarray, params: list[tuple[float, float]]) -> np.ndarray:
    logits = logit(confidences)
    columns = [sigmoid(a * logits[:, k] + b) for k, (a, b) in enumerate(params)]
    return np.stack(columns, axis=1)


def subset(rec: RoundRecords, idx: np.ndarray) -> RoundRecords:
    return RoundRecords(rec.confidences[idx], rec.verified[idx], rec.accepted[idx])


def fmt(per: np.ndarray) -> str:
    return " ".join(f"{100 * e:.1f}" for e in per)


def shift_check(config: str, work: str, drafter: str, rec: RoundRecords) -> None:
    """Is the trainer's held-out confidence bias (train/confidence_bias.py) out of sample here?

    The trainer fits δ on the validation split's teacher-forced blocks; calibrate decodes the same
    prompts. So, per fold of calibrate's conversations, δ is refitted on the validation samples of
    the *other* fold's prompts only and that fold's ECE compared with the shipped δ's and none."""
    import torch

    from dspark_cli.cache.reader import CacheDataset
    from dspark_cli.config import load_config
    from dspark_cli.manifest import read_manifest
    from dspark_cli.model.export import load_drafter
    from dspark_cli.pipeline import stage_output
    from dspark_cli.train.confidence_bias import fit_shift, flatten_slots
    from dspark_cli.train.loss import DrafterLoss, LossWeights
    from dspark_cli.train.validate import evaluate

    found = read_manifest(drafter) or {}
    shipped = ((found.get("extra") or {}).get("confidence_bias") or {}).get("shift")
    if shipped is None or rec.groups is None:
        print(f"  shift check: {drafter} records no held-out confidence bias; nothing to check")
        return
    cfg = load_config(config, [f"pipeline.work_dir={work}"], extra={})
    tc = cfg.train
    trained = load_drafter(found["extra"]["checkpoint"])  # the checkpoint: the bias before the shift
    validation = CacheDataset(stage_output(cfg, "cache"), split="validation")
    slots: list = []
    loss = DrafterLoss(trained, LossWeights(tc.ce_weight, tc.tv_weight, tc.conf_weight, tc.gamma_decay))
    evaluate(loss, validation, trained.config, num_anchors=tc.num_anchors, seed=tc.seed, micro_batch=1,
             limit=tc.eval_samples, device=torch.device("cpu"), flex=False, confidence_out=slots)
    ids = [validation[i].sample_id for i in range(min(tc.eval_samples, len(validation)))]
    trained_logits = logit(rec.confidences) - shipped
    for name, fold in zip(("A", "B"), rec.folds(), strict=True):
        others = set(rec.groups[~fold].tolist())
        picked = [slots[i] for i, sid in enumerate(ids) if sid in others]
        if not picked:
            print(f"  shift check, fold {name}: no validation sample of the other fold's prompts")
            continue
        delta = fit_shift(*flatten_slots(picked))
        part = rec.subset(fold)
        logits = trained_logits[fold]
        scores = [pooled_ece(part, sigmoid(logits + d))[0] for d in (0.0, shipped, delta)]
        print(f"  shift check, fold {name} ({fold.sum()} rounds): ECE with no shift {100 * scores[0]:.2f}, "
              f"the shipped {shipped:+.3f} {100 * scores[1]:.2f}, "
              f"{delta:+.3f} from the other fold's {len(picked)} prompts {100 * scores[2]:.2f}")


def binning_floor(rec: RoundRecords, rounds: int, draws: int = 30, seed: int = 0) -> tuple[float, float]:
    """Mean and sd of the pooled ECE a perfectly calibrated head would score on `rounds` rounds:
    rounds resampled from these confidences, each slot accepted with exactly its confidence. Any
    ECE goal below it cannot be told apart from bin noise at that many rounds."""
    rng = np.random.default_rng(seed)
    scores = []
    for _ in range(draws):
        conf = rec.confidences[rng.integers(0, len(rec.confidences), rounds)]
        ok = rng.random(conf.shape) < conf
        accepted = np.argmin(np.concatenate([ok, np.zeros((rounds, 1), bool)], axis=1), axis=1)
        sim = RoundRecords(conf, np.full(rounds, rec.gamma), accepted)
        scores.append(pooled_ece(sim, sim.confidences)[0])
    return float(np.mean(scores)), float(np.std(scores))


def threshold_study(draws: int = 150, seed: int = 0) -> None:
    """One slot; true acceptance q ~ Beta around a base rate; the head reports σ(power·logit q).
    Fit T (no minimum) on rounds holding m prefixes of the rarer outcome, score on 40 000 fresh
    rounds: how often the fit is worse than the raw head, its median ECE change, grid-edge fits."""
    rng = np.random.default_rng(seed)

    def draw(n: int, rate: float, power: float) -> tuple[np.ndarray, np.ndarray]:
        a, b = (2 * rate / (1 - rate), 2.0) if rate < 0.5 else (2.0, 2 * (1 - rate) / rate)
        q = rng.beta(a, b, n)
        return scale(q[:, None], [1 / power]), rng.random(n) < q

    print("base rate, head power, m (rarer prefixes): P(STS worse than raw), median ECE change, edge fits")
    for rate in (0.1, 0.3):
        for power in (1.0, 1.5):
            test_conf, test_labels = draw(40_000, rate, power)
            raw = ece(test_conf[:, 0], test_labels)
            for m in (5, 10, 20, 30, 50, 100):
                n = int(m / min(rate, 1 - rate))
                change, worse, edge = [], 0, 0
                for _ in range(draws):
                    conf, labels = draw(n, rate, power)
                    temps, status = fit_temperatures(RoundRecords(conf, np.ones(n, int), labels.astype(int)),
                                                     min_prefixes=1, held_out_check=False)
                    after = ece(scale(test_conf, temps)[:, 0], test_labels)
                    change.append(after - raw)
                    worse += after > raw
                    edge += status[0] == BOUNDARY
                print(f"  {rate:.1f}, ×{power:.1f}, m={m:3d} (n={n:4d}): P(worse) {worse / draws:.2f}, "
                      f"median {100 * np.median(change):+.1f} pt, edge {edge / draws:.2f}", flush=True)


def held_out_check_study(seeds: int = 6, n: int = 600, per_conversation: int = 10) -> None:
    """Cross-fitted pooled ECE of STS with and without the held-out check (`fit_temperatures`), on
    synthetic rounds: 4 slots, true acceptance q ~ U(0.05, 0.6), the head reports σ(power·logit q),
    rounds in conversations of `per_conversation`."""
    print(f"held-out check: cross-fitted pooled ECE in % (raw / checked / unchecked), {n} rounds, "
          f"conversations of {per_conversation}")
    for power in (1.0, 1.5):
        for seed in range(seeds):
            rng = np.random.default_rng(seed)
            q = rng.uniform(0.05, 0.6, (n, 4))
            slot_ok = rng.random((n, 4)) < q
            accepted = np.argmin(np.concatenate([slot_ok, np.zeros((n, 1), bool)], 1), axis=1)
            groups = np.array([f"c{i // per_conversation}" for i in range(n)], dtype=object)
            rec = RoundRecords(scale(q, [1 / power] * 4), np.full(n, 4), accepted, groups)
            checked = cross_fit(rec, 0.05, 10.0, 120)
            unchecked = cross_fit(rec, 0.05, 10.0, 120, held_out_check=False)
            print(f"  head ×{power:.1f}, seed {seed}: {100 * checked.pooled_before:.2f} / "
                  f"{100 * checked.pooled_after:.2f} / {100 * unchecked.pooled_after:.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="pipelines/smollm2-135m.toml")
    ap.add_argument("--work", default="runs/smollm2-135m-dspark", help="Work root with prompts/.")
    ap.add_argument("--drafter", default="runs/smollm2-135m-dspark/train-bench-dspark")
    ap.add_argument("--threshold-study", action="store_true",
                    help="Only the synthetic study behind calibrate.min_prefixes.")
    ap.add_argument("--held-out-check-study", action="store_true",
                    help="Only the synthetic study behind calibrate's held-out check.")
    args = ap.parse_args()
    if args.threshold_study:
        threshold_study()
        return
    if args.held_out_check_study:
        held_out_check_study()
        return
    from dspark_cli.errors import DsparkError

    try:
        rec = decode_rounds(args.config, args.work, args.drafter)
    except DsparkError as e:  # e.g. no bench-quality drafter yet
        sys.exit(f"error: {e}\nhint: run `make bench-quality` first, or pass --drafter and --work.")
    n = len(rec.confidences)
    print(f"bench-calibration: {args.drafter}, {n} rounds of the calibrate stage's prompts; ECE in %, "
          "pooled (per position 1..γ)")
    raw, raw_per = pooled_ece(rec, rec.confidences)
    sts = scale(rec.confidences, fit_sts(rec).temperatures)
    platt = apply_platt(rec.confidences, fit_platt(rec))
    (s, s_per), (p, p_per) = pooled_ece(rec, sts), pooled_ece(rec, platt)
    print(f"  in-sample   raw {100 * raw:.2f} ({fmt(raw_per)})")
    print(f"  in-sample   STS {100 * s:.2f} ({fmt(s_per)})")
    print(f"  in-sample Platt {100 * p:.2f} ({fmt(p_per)})")
    for rounds in (n // 2, n):
        mean, sd = binning_floor(rec, rounds)
        print(f"  floor: a perfectly calibrated head scores {100 * mean:.2f} ± {100 * sd:.2f} "
              f"on {rounds} rounds")
    shift_check(args.config, args.work, args.drafter, rec)
    half = n // 2
    for name, fit_idx, test_idx in (("first half → second", np.arange(half), np.arange(half, n)),
                                    ("second half → first", np.arange(half, n), np.arange(half))):
        fit_on, test_on = subset(rec, fit_idx), subset(rec, test_idx)
        r, _ = pooled_ece(test_on, test_on.confidences)
        s, s_per = pooled_ece(test_on, scale(test_on.confidences, fit_sts(fit_on).temperatures))
        p, p_per = pooled_ece(test_on, apply_platt(test_on.confidences, fit_platt(fit_on)))
        print(f"  cross-fitted {name}: raw {100 * r:.2f}, STS {100 * s:.2f} "
              f"(position 1: {100 * s_per[0]:.1f}), Platt {100 * p:.2f} (position 1: {100 * p_per[0]:.1f})")


if __name__ == "__main__":
    main()
