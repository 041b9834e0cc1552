"""The one engine-model loader of the `duetime bench ... --engine` modes.

Each engine mode used to set torch's threads and load its model its own way;
they differ only in what they accept (a clock, a GGUF path), which each mode
checks before calling this.
"""

from __future__ import annotations

from typing import Any


def load_engine(spec: str, dtype: str, threads: int, clock: str | None = None) -> Any:
    """``gemma``, ``tiny`` (random weights) or a GGUF path, on ``threads`` torch threads.

    ``clock``: checked against ``threads`` first, so a bad one fails before the
    (slow) load rather than after.
    """
    import torch

    from duetime.bench.engine_fit import bench_clock, load_bench_model

    if clock is not None:
        bench_clock(clock, threads)
    torch.set_num_threads(threads)
    return load_bench_model(spec, dtype)
