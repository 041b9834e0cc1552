"""What ``bench engine`` reads of the machine and of the model besides time.

The machine line (CPU name, copy bandwidth: a decode step is memory-bound, so
bandwidth sets its floor), the process's resident memory, and the bytes a step
reads (weights and KV), from which a row's GB/s is derived.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import torch

from duetime.cpu import cpu_name
from duetime.engine.config import Gemma3Config
from duetime.engine.gemma3 import Gemma3
from duetime.engine.rescored_head import RescoredInt8Head

__all__ = [
    "cpu_name",
    "kv_bytes_read",
    "memory_bandwidth_gb_s",
    "page_in",
    "peak_rss_mib",
    "rss_mib",
    "rss_reset",
    "weight_bytes",
]


def memory_bandwidth_gb_s(mb: int = 512, reps: int = 5) -> float:
    """Best-of-``reps`` bandwidth of ``dst.copy_(src)`` (read + write bytes), GB/s."""
    src = torch.ones(mb * 2**20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.nbytes / best / 1e9


def rss_reset() -> None:
    with contextlib.suppress(OSError):  # Linux only: resets VmHWM to the current RSS
        Path("/proc/self/clear_refs").write_text("5")


def peak_rss_mib() -> float | None:
    """This process's peak resident memory since :func:`rss_reset`, MiB (VmHWM, KiB)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def page_in(weights: dict[str, torch.Tensor]) -> float:
    """Read one value of every page of the shared weights; the RSS that added, MiB.

    The weight cache is memory-mapped: its pages come in when first read, by
    whichever variant is built first, which would be charged ~1 GB of own RSS for
    them. Read here, they count for none.
    """
    rss0 = rss_mib()
    for t in weights.values():
        if t.numel():
            t.reshape(-1)[:: max(1, 4096 // t.element_size())].sum()  # a value a 4 KiB page
    return rss_mib() - rss0


def rss_mib() -> float:
    """This process's resident memory now, MiB (NaN where /proc cannot say)."""
    try:
        return (
            int(Path("/proc/self/statm").read_text().split()[1])
            * os.sysconf("SC_PAGE_SIZE")
            / 2**20
        )
    except (OSError, ValueError, IndexError):
        return float("nan")


def weight_bytes(model: Gemma3, rows: int = 1) -> int:
    """Weight bytes a step of ``rows`` rows reads (``q8`` reads int8 only for few rows)."""

    def nbytes(lin: Any) -> int:
        fn = getattr(lin, "bytes_read", None)
        return int(fn(rows)) if fn is not None else int(lin.nbytes)

    layers = sum(nbytes(lin) for ly in model.layers for lin in (ly.qkv, ly.o, ly.gate_up, ly.down))
    head = model.lm_head
    if isinstance(head, RescoredInt8Head):  # the bench decodes greedily
        return layers + head.bytes_read(rows, argmax_only=True)
    return layers + nbytes(head)


def kv_bytes_read(cfg: Gemma3Config, batch: int, ctx: int, itemsize: int) -> int:
    per_layer = [min(ctx, cfg.sliding_window) if s else ctx for s in cfg.sliding_layers]
    return batch * sum(per_layer) * 2 * cfg.num_kv_heads * cfg.head_dim * itemsize
