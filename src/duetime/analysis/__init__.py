"""Closed-form models from the papers: what the simulator's numbers are checked against."""
