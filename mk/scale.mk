# Open-PerfectBlend scale (issue 27, docs/data.md "At scale"): `data prepare` on a generated file with
# the data set's 1,420,909 rows (and 100k, 400k), `data regen` of 20k and 200k prompts against the
# fixture server (the 200k run kill -9'd half way, then rerun: each prompt once), a 20k and a 100k
# sample cache of a narrow target and `train`'s start-up on it. One line per stage and size:
# `bench-scale STAGE n=N seconds=S peak_rss_mb=M`. About 35 minutes on 2 shared cores, ~5 GB of disk
# under runs/bench-scale (deleted at the end; --keep keeps it).
.PHONY: bench-scale

bench-scale: demo-model
	$(BIN)/python -m benchmarks.bench_scale
