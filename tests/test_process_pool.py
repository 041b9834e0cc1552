"""Pools for sweeps and benchmarks start their workers clean (not by fork)."""

from __future__ import annotations

import torch

from duetime.process_pool import process_pool


def _torch_sum(n: int) -> float:
    torch.set_num_threads(2)
    a = torch.ones(n, n)
    return float((a @ a).sum())


def test_workers_are_not_forked_and_compute_with_torch_after_the_parent_did() -> None:
    torch.set_num_threads(2)
    (torch.randn(256, 256) @ torch.randn(256, 256)).sum()  # the parent's thread pool runs
    with process_pool(2) as pool:
        assert pool._mp_context.get_start_method() in ("forkserver", "spawn")
        assert list(pool.map(_torch_sum, [4, 8])) == [64.0, 512.0]
    with process_pool(0) as pool:  # at least one worker
        assert pool._max_workers == 1
