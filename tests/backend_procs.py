"""`duetime serve` backends as subprocesses, for the tests of the gateway and of shutdown:
start one on the tiny model, wait until it answers /health."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from duetime.server.ports import free_port

DUETIME = Path(sys.executable).with_name("duetime")


def start_backend() -> tuple[subprocess.Popen, str]:
    """A tiny-model `duetime serve` on a free port, one thread, quiet; and its URL."""
    port = free_port()
    cmd = [str(DUETIME), "serve", "--model", "tiny", "--port", str(port)]
    cmd += ["--predictor", "none", "--log-level", "warning", "--threads", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return proc, f"http://127.0.0.1:{port}"


def wait_healthy(proc: subprocess.Popen, url: str, timeout: float = 60.0) -> None:
    """Return once ``url`` answers /health with 200; fail if the process exits or the
    timeout passes first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"backend {url} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=0.5, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    pytest.fail(f"backend {url} did not start")
