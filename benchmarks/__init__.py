"""Benchmark of exact speculative decoding (`python -m benchmarks`, `specdec-bench`).

Reproduces vLLM PR 10198's as-is vs fixed acceptance table on the local pair and measures
speedup against target-only decoding and transformers' assisted generation, with a guard
against fast-but-wrong (see docs/benchmark.md)."""
