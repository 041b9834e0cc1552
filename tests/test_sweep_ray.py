"""Sweeps on Ray: a local Ray runs the same specs to the same rows as the process pool."""

from __future__ import annotations

import socket
import time

import pytest
import ray

from duetime.experiment import SimSpec
from duetime.sweep import run_sweep


def test_a_ray_sweep_gives_the_serial_rows() -> None:
    specs = [
        SimSpec(policy="fcfs", requests=150, rate=6.0, seed=s, replicas=2, router=r)
        for s in (0, 1)
        for r in ("lor", "round-robin")
    ]
    specs.append(SimSpec(policy="edf", requests=150, rate=6.0, deadline_scale=4.0))
    want = run_sweep(specs, backend="serial")
    try:
        got = run_sweep(specs, workers=2, backend="ray")  # starts a local Ray
        assert ray.is_initialized()
    finally:
        ray.shutdown()

    def same(row: dict) -> dict:
        return {k: v for k, v in row.items() if k != "wall_s"}

    assert [same(r) for r in got] == [same(r) for r in want]
    assert [r["router"] for r in got[:4]] == ["lor", "round-robin", "lor", "round-robin"]
    assert "router" not in got[4]  # one engine: today's row


def test_a_ray_address_nothing_answers_at_is_refused_in_seconds() -> None:
    """Ray retries such an address for about two minutes before it gives up."""
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spec = SimSpec(policy="fcfs", requests=20, rate=6.0)
    t0 = time.monotonic()
    for address in (f"127.0.0.1:{port}", f"ray://127.0.0.1:{port}"):
        with pytest.raises(ValueError, match=f"nothing answers at 127.0.0.1:{port}"):
            run_sweep([spec, spec], workers=2, backend="ray", ray_address=address)
    with pytest.raises(ValueError, match="give ray://HOST:PORT"):
        run_sweep([spec, spec], workers=2, backend="ray", ray_address="ray://:x")
    assert time.monotonic() - t0 < 30
    assert not ray.is_initialized()
