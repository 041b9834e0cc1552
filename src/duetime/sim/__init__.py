"""Discrete-event simulator of an LLM serving engine."""

from duetime.sim.simulator import SimConfig, SimResult, Simulator, simulate

__all__ = ["SimConfig", "SimResult", "Simulator", "simulate"]
