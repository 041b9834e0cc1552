"""Predictors: response length, execution time, throughput."""
