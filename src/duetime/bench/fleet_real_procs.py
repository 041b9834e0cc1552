"""The real fleet of `duetime bench fleet-real`: `duetime serve` backends and a
`duetime gateway` in front of them, each its own process on this machine.

Every process is started through :class:`LocalProcesses`, which ends all of them
when its ``with`` block is left: normally, on an error, on Ctrl-C, and on SIGTERM
(turned into ``SystemExit`` while the block runs, so the ``finally`` runs instead
of the interpreter dying with its children still serving). A benchmark that left
two engines behind would steal the cores of every run after it.

A process that exits, or does not answer ``/health`` in time, is a
:class:`FleetStartError` naming its URL and quoting the end of its log: the
likely cause (a port taken, a model that does not load) is in there.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

__all__ = ["FleetStartError", "LocalProcesses", "Started", "free_port"]

#: What runs `duetime` in a child: this interpreter, so the child runs this code
#: (the PYTHONPATH in the environment included), not whatever `duetime` is on PATH.
_DUETIME = (sys.executable, "-c", "from duetime.cli import app; app()")


class FleetStartError(RuntimeError):
    """A backend or the gateway did not come up healthy (the message names its URL)."""


@dataclass(slots=True)
class Started:
    """One process this run started: what it is, where it answers, its log."""

    what: str  # "backend" or "gateway"
    url: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 5) -> str:
        """The last lines of its output (stdout and stderr), for an error message."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        kept = [line for line in text.splitlines() if line.strip()][-lines:]
        return " | ".join(line.strip() for line in kept)


def free_port() -> int:
    """A TCP port free on loopback now (the child binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalProcesses:
    """Starts processes and ends every one of them on exit (module docstring)."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.started: list[Started] = []
        self._old_term: Any = None

    def __enter__(self) -> LocalProcesses:
        if threading.current_thread() is threading.main_thread():
            self._old_term = signal.signal(signal.SIGTERM, _exit_on_term)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop_all()
        finally:
            if self._old_term is not None:
                signal.signal(signal.SIGTERM, self._old_term)
                self._old_term = None

    def start(self, what: str, args: Sequence[str], port: int, threads: int = 1) -> Started:
        """Run ``duetime *args`` (which must bind ``port``) with ``threads`` OpenMP threads."""
        url = f"http://127.0.0.1:{port}"
        log = self.logs / f"{what}-{port}.log"
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        with log.open("wb") as sink:
            proc = subprocess.Popen(
                [*_DUETIME, *args], stdout=sink, stderr=subprocess.STDOUT, env=env
            )
        started = Started(what, url, proc, log)
        self.started.append(started)
        return started

    def wait_healthy(
        self,
        started: Started,
        timeout_s: float,
        ready: Callable[[httpx.Response], bool] | None = None,
    ) -> None:
        """Until ``GET /health`` answers 200 (and ``ready`` of that answer holds)."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                code = started.proc.poll()
                if code is not None:
                    raise FleetStartError(
                        f"{started.what} {started.url} exited with code {code} before it "
                        f"was healthy; its log ends: {started.tail() or '(empty)'}"
                    )
                try:
                    r = client.get(started.url + "/health")
                    if r.status_code == 200 and (ready is None or ready(r)):
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise FleetStartError(
                        f"{started.what} {started.url} was not healthy after {timeout_s:g} s; "
                        f"its log ends: {started.tail() or '(empty)'}"
                    )
                time.sleep(0.2)

    def stop(self, started: Started) -> None:
        """End one process: SIGTERM, then SIGKILL if it has not left within 5 s."""
        proc = started.proc
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10.0)
        if started in self.started:
            self.started.remove(started)

    def stop_all(self) -> None:
        """End every process still held, the last started first (the gateway, then its
        backends); each one is tried even when ending another failed."""
        errors: list[BaseException] = []
        for started in reversed(list(self.started)):
            try:
                self.stop(started)
            except BaseException as e:  # the others must still be ended
                errors.append(e)
                if started.proc.poll() is None:
                    started.proc.kill()
        if errors:
            raise errors[0]


def _exit_on_term(signum: int, frame: FrameType | None) -> None:
    """SIGTERM while the fleet runs: leave through ``finally``, so it is ended too."""
    raise SystemExit(128 + signum)
