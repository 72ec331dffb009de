# Target cache benchmark on the real SmolLM2-135M-Instruct (docs/cache.md). About 6-9 minutes on 2 CPU cores.
bench-cache: install
	$(BIN)/python -m benchmarks.bench_cache --samples 200 --max-new-tokens 64
