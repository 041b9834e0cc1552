"""Benchmarks: one module per reproduced result, plus performance benchmarks."""
