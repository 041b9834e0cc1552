"""Process pools whose workers start clean, for sweeps and benchmarks that fan out.

Why not the platform default: on Linux that is ``fork``, which copies a parent
whose torch (OpenMP) thread pool may already be running, and a child that then
computes with torch can crash. It did: ``bench amin --learned learned:minilm-ft``
called from a process that had run torch before segfaulted in its worker, inside
the fine-tuned encoder's first matrix product. ``forkserver`` forks workers from
a fresh server process instead (``spawn`` where there is none), at the price of a
second or so to import duetime in each worker once (Python 3.14 made the same
choice its default). As with any such pool, a script that starts one needs the
``if __name__ == "__main__":`` guard: its workers import it.
"""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor

__all__ = ["process_pool"]


def process_pool(workers: int) -> ProcessPoolExecutor:
    """A pool of ``workers`` (at least 1) processes started by forkserver or spawn."""
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    return ProcessPoolExecutor(max_workers=max(1, workers), mp_context=context)
