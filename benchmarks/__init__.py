"""Scripts that print side-by-side tables: `python -m benchmarks.<name>`."""
