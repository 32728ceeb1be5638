"""Benchmarks that are run again as the code changes: each compares the job with a floor measured in the same run and
prints JSON, then `name: value` lines (docs/performance.md). Run from a checkout where the project is installed
(`pip install -e .`): `python bench/throughput.py`, or `python -m bench.throughput`."""
