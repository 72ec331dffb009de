# Eval stage (docs/eval.md): losslessness audit, STS, SPS of SmolLM2-135M on this machine, and —
# once `make demo` has trained a drafter — speculative decoding under each schedule.
.PHONY: bench-eval bench-decode audit test-eval bench-calibration bench-draft-candidates bench-prepack

## Audit p-values + synthetic STS + SPS(B) of SmolLM2 (+ decoding when the demo drafter exists).
bench-eval: demo-model
	$(BIN)/python -m benchmarks.bench_eval --drafter runs/smollm2-135m-dspark/train --limit 5 --max-new-tokens 64

## The losslessness audit alone (chi-square per scheduling policy).
audit: install
	$(BIN)/dspark eval audit --samples 4000

## Only the eval-stage tests.
test-eval: install
	$(BIN)/python -m pytest -q tests/test_decode_sampling.py tests/test_scheduler.py tests/test_calibrate.py \
		tests/test_audit.py tests/test_eval_e2e.py tests/test_decode_batch.py

## STS vs a per-position offset (Platt) on the bench-quality DSpark drafter's calibration rounds.
bench-calibration: demo-model
	$(BIN)/python -m benchmarks.bench_calibration

## Decode speed on the demo's target and drafter (issue 16): t₁…t₈, draft/verify split, c, τ,
## speed-up vs predicted, SPS(B) of the batched forward and the measured Figure 8 (a few minutes
## once the demo exists). Builds the demo first when its drafter is missing.
DEMO_WORK := runs/smollm2-135m-dspark
bench-decode: demo-model
	test -f $(DEMO_WORK)/train/manifest.json -a -f $(DEMO_WORK)/calibration/manifest.json || \
		$(BIN)/dspark pipeline run pipelines/smollm2-135m.toml --stages prepare,regen,cache,train,calibrate
	$(BIN)/python -m benchmarks.bench_decode --drafter $(DEMO_WORK)/train \
		--calibration $(DEMO_WORK)/calibration/calibration.json

## The target's prepacked linears against the plain ones (target/prepack.py): verification of
## 1-8 tokens, a 32-sequence server step, a cache prefill (~2 minutes).
bench-prepack: demo-model
	$(BIN)/python -m benchmarks.bench_prepack

## τ of the demo drafter with each top-k candidate rule (base logits alone, + the Markov bias's
## favoured tokens, the whole vocabulary), same conversations and seeds (~6 minutes).
bench-draft-candidates: demo-model
	test -f $(DEMO_WORK)/train/manifest.json || \
		$(BIN)/dspark pipeline run pipelines/smollm2-135m.toml --stages prepare,regen,cache,train
	$(BIN)/python -m benchmarks.bench_draft_candidates --drafter $(DEMO_WORK)/train
