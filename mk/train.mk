# Drafter training benchmark (docs/train.md): throughput and peak memory, chunked loss on vs off.
.PHONY: bench-train
bench-train: install
	$(BIN)/python benchmarks/bench_train.py --draft-layers 1 --steps 1 --threads 2
