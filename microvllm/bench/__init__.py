"""Benchmarks (``python -m microvllm bench <name>``)."""
