"""hpref benchmarks: `python -m benchmarks.run [--quick]` (see benchmarks/README.md)."""
