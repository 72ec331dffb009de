# Drafter training benchmark (docs/train.md): steps/s and achieved vs peak FLOP/s of
# train.fast_kernels on vs off (the earlier path), same shapes, same run; bf16 autocast where the
# CPU has native bf16 (AMX/AVX512-BF16), fp32 elsewhere (PyTorch's bf16 fallback gemm is ~10x slower).
.PHONY: bench-train
bench-train: install
	$(BIN)/python -m benchmarks.bench_train --draft-layers 2 --steps 5 --threads 2 --precision auto

# Online training (the target in the loop) vs from the cache on SmolLM2 and the demo's responses
# (docs/train.md): s/step, peak memory, τ of both drafters, break-even epochs. Builds what is missing.
.PHONY: bench-online
bench-online: demo-model
	$(BIN)/python -m benchmarks.bench_online --steps 60

## A fresh drafter's final-norm gain: the release before (1) vs auto, one demo-budget training
## each on the demo's cache (builds the shared stages when missing; ~15 min on 2 cores).
.PHONY: bench-init
bench-init: demo-model
	$(BIN)/python -m benchmarks.bench_init
