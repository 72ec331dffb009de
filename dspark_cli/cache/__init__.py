"""Target hidden states in chunked Zarr shards: build, read, verify, estimate."""

RESPONSES_HINT = "pass the output of `dspark data regen` (default <work_dir>/responses) as --responses."
