# Eval stage (docs/eval.md): losslessness audit, STS, SPS of SmolLM2-135M on this machine, and —
# once `make demo` has trained a drafter — speculative decoding under each schedule.
.PHONY: bench-eval audit test-eval bench-calibration

## Audit p-values + synthetic STS + SPS(B) of SmolLM2 (+ decoding when the demo drafter exists).
bench-eval: demo-model
	$(BIN)/python benchmarks/bench_eval.py --drafter runs/smollm2-135m-dspark/train --limit 5 --max-new-tokens 64

## The losslessness audit alone (chi-square per scheduling policy).
audit: install
	$(BIN)/dspark eval audit --samples 4000

## Only the eval-stage tests.
test-eval: install
	$(BIN)/python -m pytest -q tests/test_decode_sampling.py tests/test_scheduler.py tests/test_calibrate.py \
		tests/test_audit.py tests/test_eval_e2e.py

## STS vs a per-position offset (Platt) on the bench-quality DSpark drafter's calibration rounds.
bench-calibration: demo-model
	$(BIN)/python benchmarks/bench_calibration.py
