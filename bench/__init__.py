"""Benchmarks: each script prints a table last and writes JSON to bench/results/."""
