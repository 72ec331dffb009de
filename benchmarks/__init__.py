"""Benchmarks, run as modules from the repository: `python -m benchmarks.bench_quality`."""
