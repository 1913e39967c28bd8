"""Benchmarks that compare builder with the standard tools, as ratios: `python3 -m bench.run`."""
