# The SmolLM2-135M demo pipeline and the DSpark-vs-DFlash quality benchmark (docs/demo.md).
.PHONY: demo demo-model bench-quality bench-quality-curve bench-factors

SMOLLM2 := runs/models/smollm2-135m-instruct

## The bundled SmolLM2-135M-Instruct GGUF as a plain safetensors target (once).
demo-model: install
	test -f $(SMOLLM2)/conversion.json || $(BIN)/dspark model convert --smollm2 $(SMOLLM2)

## Whole pipeline on SmolLM2-135M (prepare → serve+regen → cache → train → calibrate → eval), then
## the short report. Finished stages are reused on a rerun.
demo: demo-model
	$(BIN)/dspark pipeline run pipelines/smollm2-135m.toml
	$(BIN)/dspark pipeline report pipelines/smollm2-135m.toml

## DSpark vs DFlash on the same data and budget, T=1, held-out GSM8K + HumanEval (+ MT-Bench).
bench-quality: demo-model
	$(BIN)/python -m benchmarks.bench_quality

## Validation τ of both bench-quality drafters at each kept checkpoint (every 148 steps), and the
## ratio: where the goal is reached along the run. Needs `make bench-quality` first.
bench-quality-curve: install
	$(BIN)/python -m benchmarks.quality_curve

## One factor at a time against the demo config (data volume, layer choice, anchors, regen
## sampling), each DSpark/DFlash pair at the same reduced budget; needs `make demo` first.
bench-factors: demo-model
	$(BIN)/python -m benchmarks.bench_factors
