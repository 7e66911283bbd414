"""The example job's parts: a small Llama-style model and deterministic synthetic data."""
