# Data stages (dspark data prepare / regen): the regen client's throughput benchmark.
.PHONY: bench-regen test-data

## Regen client against the fixture server: 200 ms replies, 64 in flight -> fraction of the ideal 320 req/s.
bench-regen: install
	$(BIN)/python -m benchmarks.bench_regen --prompts 3200 --delay 0.2 --concurrency 64 --server-workers 2

## Only the data-stage tests.
test-data: install
	$(BIN)/python -m pytest -q tests/test_data_prepare.py tests/test_data_regen.py
