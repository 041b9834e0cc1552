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
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

__all__ = ["FleetStartError", "LocalProcesses", "Started"]

#: What runs `duetime` in a child: this interpreter, so the child runs this code
#: (the PYTHONPATH in the environment included), not whatever `duetime` is on PATH.
#: SIGINT is made a KeyboardInterrupt even where this process was started with it
#: ignored (a background job's), so that :meth:`LocalProcesses.stop` can always end
#: a child by unwinding it (below).
_DUETIME = (
    sys.executable,
    "-c",
    "import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from duetime.cli import app; app()",
)
#: Seconds a child has to leave after the first SIGINT before it is killed; SIGINT is
#: sent again every ``_RESEND_S`` meanwhile (one raised inside a ``__del__`` is lost).
_STOP_GRACE_S = 20.0
_RESEND_S = 2.0
#: Seconds a child still starting is given to finish its start before it is stopped.
_START_GRACE_S = 180.0


class FleetStartError(RuntimeError):
    """A backend or the gateway did not come up healthy (the message names its URL)."""


@dataclass(slots=True)
class Started:
    """One process this run started: what it is, where it answers, its log."""

    what: str  # "backend" or "gateway"
    url: str
    proc: subprocess.Popen[bytes]
    log: Path
    #: "starting", "healthy", or "abandoned" (not healthy in time: not waited for again)
    state: str = "starting"

    def tail(self, lines: int = 5) -> str:
        """The last lines of its output (stdout and stderr), for an error message."""
        try:
            text = self.log.read_text(errors="replace")
        except OSError:
            return ""
        kept = [line for line in text.splitlines() if line.strip()][-lines:]
        return " | ".join(line.strip() for line in kept)


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
                health = _health(client, started.url)
                if (
                    health is not None
                    and health.status_code == 200
                    and (ready is None or ready(health))
                ):
                    started.state = "healthy"
                    return
                if time.monotonic() > deadline:
                    started.state = "abandoned"
                    raise FleetStartError(
                        f"{started.what} {started.url} was not healthy after {timeout_s:g} s; "
                        f"its log ends: {started.tail() or '(empty)'}"
                    )
                time.sleep(0.2)

    def stop(self, started: Started) -> None:
        """End one process: let it finish starting, SIGINT it, SIGKILL it if it stays.

        SIGINT, not SIGTERM, and never while it starts: a backend still loading its
        model dies on SIGTERM on the spot, and one that dies inside torch's extension
        build leaves that build's lock file behind, on which every later engine on this
        machine waits for ever. So a process still starting gets ``_START_GRACE_S`` to
        answer ``/health`` first (one that was given up on, not); then SIGINT, which a
        serving process takes as SIGTERM (uvicorn's graceful shutdown) and a loading one
        as a KeyboardInterrupt that unwinds, releasing what it holds.
        """
        proc = started.proc
        if proc.poll() is None and started.state == "starting":
            _await_start(started)
        until = time.monotonic() + _STOP_GRACE_S
        while proc.poll() is None and time.monotonic() < until:
            proc.send_signal(signal.SIGINT)
            with suppress(subprocess.TimeoutExpired):
                proc.wait(_RESEND_S)
        if proc.poll() is None:
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


def _health(client: httpx.Client, url: str) -> httpx.Response | None:
    """``url``'s answer to ``GET /health``, whatever its status (None: no answer yet)."""
    try:
        return client.get(url + "/health")
    except httpx.HTTPError:
        return None


def _await_start(started: Started) -> None:
    """Until ``started`` answers ``/health`` at all (it is past its start: a 503 gateway
    with no backend up counts), exits, or ``_START_GRACE_S`` pass."""
    until = time.monotonic() + _START_GRACE_S
    with httpx.Client(timeout=2.0, trust_env=False) as client:
        while started.proc.poll() is None and time.monotonic() < until:
            if _health(client, started.url) is not None:
                return
            time.sleep(0.2)


def _exit_on_term(signum: int, frame: FrameType | None) -> None:
    """SIGTERM while the fleet runs: leave through ``finally``, so it is ended too."""
    raise SystemExit(128 + signum)
