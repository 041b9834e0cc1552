"""One thread of a process computes on OpenMP's workers: the thread that steps the engine.

Why: libgomp (torch's OpenMP) keeps, for each thread that has run a parallel
region, a team of worker threads, parked between regions, and counts them. When
it counts more threads than the machine has CPUs, a worker stops spinning
between regions and sleeps at once, so every region pays a wake-up. A decode
step is hundreds of small regions (each layer's int8 products, attention and
norms). The server loads and times the model on the main thread and steps it on
a thread of its own: the main thread's parked worker made three threads on two
CPUs. On the 2-core AMD EPYC a one-sequence decode step took 12.8-13.3 ms on the
engine thread against 8.1-9.0 ms on the main thread, and 8.0-8.7 ms once the main
thread had given its worker back (a 200,000-element add: 17 µs, 61-72 µs, 20 µs).

So the thread that hands the model to the engine thread gives its workers back
(:func:`release_workers`, libgomp's ``omp_pause_resource_all``) and computes on
one thread from then on; the engine thread takes the count for itself
(:func:`own_workers`); the server's other threads that may call torch (the
length predictor's, the event loop's executor) start with
:func:`compute_on_one_thread`. torch's thread count is per thread, taken from the
last :func:`torch.set_num_threads` of any thread when a thread first computes,
hence each is set where it runs. Where torch's OpenMP is not libgomp, nothing is
released.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Any

import torch

__all__ = ["compute_on_one_thread", "libgomp", "own_workers", "release_workers"]

log = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep the settings


@functools.cache
def libgomp() -> Any | None:
    """torch's libgomp where it has one that can pause (OpenMP 5.0), else None."""
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    bundled = os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp.so.1")
    for name in (bundled, "libgomp.so.1"):
        try:
            lib = ctypes.CDLL(name)
            lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
            return lib
        except (OSError, AttributeError):
            continue
    return None


def release_workers() -> bool:
    """Give back the calling thread's parked OpenMP workers and let it (and threads
    started after it) compute on one thread; whether any workers were given back.
    Call it on the thread that computed before the engine thread took over."""
    compute_on_one_thread()
    lib = libgomp()
    if lib is None:
        return False
    ok = lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0
    if not ok:
        log.warning("libgomp kept this thread's OpenMP workers; engine steps may run slower")
    return ok


def own_workers(threads: int) -> None:
    """Compute on ``threads`` threads from the calling thread (the engine's), whatever
    other threads set later."""
    torch.get_num_threads()  # this thread's first count is taken now, not at its first step
    torch.set_num_threads(threads)


def compute_on_one_thread() -> None:
    """The calling thread computes on one thread (no OpenMP workers of its own): for
    every thread of a server but the engine's; a thread pool's ``initializer``."""
    torch.get_num_threads()  # settle this thread's count before it is changed
    torch.set_num_threads(1)
