"""Benchmark scripts: `python -m benchmarks.<name> [--quick]` (see README, Benchmarks)."""
