"""Run many :class:`SimSpec` in parallel: a process pool here, Ray to grow past one machine."""

from __future__ import annotations

import socket
from collections.abc import Callable
from concurrent.futures import as_completed
from typing import Any

from duetime.experiment import SimSpec, run_spec
from duetime.process_pool import process_pool


def run_row(spec: SimSpec) -> dict[str, Any]:
    """One spec → its summary row (records stay in the worker: they are large); a
    fleet spec's row is the fleet's."""
    from duetime.sim.fleet_run import is_fleet, run_fleet

    if is_fleet(spec):
        return run_fleet(spec)[1]
    _, row = run_spec(spec)
    return row


def run_sweep(
    specs: list[SimSpec],
    *,
    workers: int = 2,
    backend: str = "process",
    progress: Callable[[int, int], None] | None = None,
    ray_address: str | None = None,
) -> list[dict[str, Any]]:
    """Rows in the order of ``specs``. ``backend``: process (the default), ray or serial.
    With ``ray``, ``ray_address`` joins a running cluster (``ray://head:10001``, or
    ``auto`` on a node of one); without it a local Ray of ``workers`` CPUs is started."""
    n = len(specs)
    rows: list[dict[str, Any] | None] = [None] * n
    if backend == "serial" or workers == 1 or n == 1:
        for i, spec in enumerate(specs):
            rows[i] = run_row(spec)
            if progress:
                progress(i + 1, n)
    elif backend == "process":
        with process_pool(workers) as pool:
            futs = {pool.submit(run_row, s): i for i, s in enumerate(specs)}
            for done, fut in enumerate(as_completed(futs), 1):
                rows[futs[fut]] = fut.result()
                if progress:
                    progress(done, n)
    elif backend == "ray":
        rows = _ray_sweep(specs, workers, progress, ray_address)
    else:
        raise ValueError(f"unknown sweep backend {backend!r}; use process, ray or serial")
    return [r for r in rows if r is not None]


def _ray_sweep(
    specs: list[SimSpec],
    workers: int,
    progress: Callable[[int, int], None] | None,
    address: str | None = None,
) -> list[dict[str, Any] | None]:
    try:
        import ray
    except ImportError:
        raise ValueError(
            "--ray needs Ray: .venv/bin/pip install -c constraints.txt -e '.[dev]'"
        ) from None
    if not ray.is_initialized():
        if address is None:  # a local cluster (RAY_ADDRESS in the environment joins one)
            ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        else:  # the cluster's own resources: num_cpus belongs to the one that starts it
            check_reachable(address)
            ray.init(address=address, log_to_driver=False)
    remote = ray.remote(run_row)
    refs = [remote.remote(s) for s in specs]
    index = {r: i for i, r in enumerate(refs)}
    rows: list[dict[str, Any] | None] = [None] * len(specs)
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        rows[index[ready[0]]] = ray.get(ready[0])
        if progress:
            progress(len(specs) - len(pending), len(specs))
    return rows


#: Seconds a Ray address has to accept a connection: Ray itself retries an address no
#: cluster answers at for about two minutes before it gives up.
CONNECT_TIMEOUT_S = 5.0


def check_reachable(address: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Refuse a Ray address nothing listens at, in seconds rather than Ray's minutes:
    ``ray://HOST[:PORT]`` (a Ray Client server, port 10001) or ``HOST[:PORT]`` (the
    head's GCS, port 6379); ``auto`` and ``local`` are Ray's to find."""
    if address in ("auto", "local"):
        return
    client = address.startswith("ray://")
    where = address.removeprefix("ray://")
    host, colon, port = where.rpartition(":")
    if not colon:
        host, port = where, "10001" if client else "6379"
    host = host.strip("[]")  # an IPv6 address in brackets
    if not host or not port.isdigit():
        raise ValueError(f"--ray-address {address!r}: give ray://HOST:PORT, HOST:PORT or auto")
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise ValueError(
            f"--ray-address {address}: nothing answers at {host}:{port} within "
            f"{timeout_s:g} s ({e.strerror or e}); is the Ray cluster up?"
        ) from None
