"""Microbenchmark of the int8 weight-only kernel alone against its memory roofline.

``python -m duetime.bench.q8_kernel_speed --json out/q8-kernel.json``

Times the products of one Gemma 3 270M decode step: the 72 layer matmuls (18
layers × fused q/k/v 1536×640, o 640×1024, fused gate/up 4096×640, down
640×2048, each layer with its own random weight so they stream from memory as in
a real step) and the 262,144 × 640 output layer, at 1-16 rows, for the q8
kernel and for the oneDNN-packed fp32 path it replaces, interleaved
(variant after variant within each repetition) and reported as medians.

Roofline: the time to read the weights once at the bandwidth of a large
``torch`` copy (``memory_bandwidth_gb_s``, read + write bytes per second, as in
``bench engine``); ``roofline_fraction`` = roofline time ÷ measured time.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from duetime.bench.engine_speed import memory_bandwidth_gb_s
from duetime.engine.linear import PackedLinear, packed_available
from duetime.engine.q8_kernel import q8_available, q8_linear, quantize_q8

__all__ = ["LAYER_SHAPES", "run"]

LAYER_SHAPES = ((1536, 640), (640, 1024), (4096, 640), (640, 2048))
HEAD_SHAPE = (262_144, 640)


def _time_ms(
    fns: Sequence[Callable[[torch.Tensor], torch.Tensor]], xs: list[torch.Tensor]
) -> float:
    """Wall time of one pass over every product, in ms."""
    t = time.perf_counter()
    for f, x in zip(fns, xs, strict=True):
        f(x)
    return (time.perf_counter() - t) * 1e3


class _Q8:
    def __init__(self, w: torch.Tensor) -> None:
        self.q = quantize_q8(w)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return q8_linear(x, self.q)


class _Dense:
    def __init__(self, w: torch.Tensor) -> None:
        self.w = w

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.w)


def run(
    rows: Sequence[int] = (1, 2, 4, 8, 16),
    *,
    layers: int = 18,
    reps: int = 7,
    head: bool = True,
    threads: int | None = None,
    probe_mb: int = 512,
) -> dict[str, Any]:
    """Figures per (product group, rows): q8 and fp32 ms, GB/s, roofline (JSON-ready)."""
    if not q8_available():
        raise RuntimeError("the int8 kernel could not be built here (see the warning above)")
    if threads is not None:
        torch.set_num_threads(threads)
    bandwidth = memory_bandwidth_gb_s(probe_mb)
    g = torch.Generator().manual_seed(0)
    groups: dict[str, list[torch.Tensor]] = {
        "layers": [torch.randn(s, generator=g) * 0.02 for _ in range(layers) for s in LAYER_SHAPES]
    }
    if head:
        groups["output_layer"] = [torch.randn(HEAD_SHAPE, generator=g) * 0.02]
    out: list[dict[str, Any]] = []
    for group, weights in groups.items():
        q8 = [_Q8(w) for w in weights]
        fp32: list[Callable[[torch.Tensor], torch.Tensor]] = [
            PackedLinear(w) if packed_available() else _Dense(w) for w in weights
        ]
        shapes = [tuple(w.shape) for w in weights]
        del weights
        q8_bytes = sum(f.q.nbytes for f in q8)
        fp32_bytes = sum(n * k * 4 for n, k in shapes)
        for m in rows:
            xs = [torch.randn(m, k, generator=g) for _, k in shapes]
            tq: list[float] = []
            tf: list[float] = []
            for _ in range(reps):
                tq.append(_time_ms(q8, xs))
                tf.append(_time_ms(fp32, xs))
            mq, mf = statistics.median(tq), statistics.median(tf)
            roof_ms = q8_bytes / (bandwidth * 1e9) * 1e3
            out.append(
                {
                    "group": group,
                    "rows": m,
                    "q8_ms": mq,
                    "fp32_packed_ms": mf,
                    "speedup_vs_fp32": mf / mq,
                    "q8_weight_mb": q8_bytes / 1e6,
                    "fp32_weight_mb": fp32_bytes / 1e6,
                    "q8_gb_s": q8_bytes / mq / 1e6,
                    "fp32_gb_s": fp32_bytes / mf / 1e6,
                    "roofline_ms": roof_ms,
                    "roofline_fraction": roof_ms / mq,
                }
            )
    return {
        "memory_bandwidth_gb_s": bandwidth,
        "torch_threads": torch.get_num_threads(),
        "reps": reps,
        "cells": out,
    }


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: print a table, optionally write ``--json``."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16", help="row counts, comma-separated")
    ap.add_argument("--reps", type=int, default=7, help="interleaved repetitions (medians)")
    ap.add_argument("--layers", type=int, default=18, help="decoder layers' worth of matmuls")
    ap.add_argument("--threads", type=int, default=None, help="torch threads")
    ap.add_argument("--no-head", action="store_true", help="skip the 262k-row output layer")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    a = ap.parse_args(argv)
    try:
        rows = tuple(int(x) for x in a.rows.split(",") if x)
        if not rows or min(rows) < 1 or a.reps < 1 or a.layers < 1:
            raise ValueError
    except ValueError:
        ap.error(f"--rows must be positive integers, --reps and --layers >= 1 (got {a.rows!r})")
    fig = run(rows, layers=a.layers, reps=a.reps, head=not a.no_head, threads=a.threads)
    print(
        f"copy bandwidth {fig['memory_bandwidth_gb_s']:.1f} GB/s, "
        f"{fig['torch_threads']} threads, medians of {fig['reps']}"
    )
    for c in fig["cells"]:
        print(
            f"{c['group']:>12} rows {c['rows']:>2}: q8 {c['q8_ms']:7.1f} ms "
            f"({c['q8_gb_s']:5.1f} GB/s, roofline {c['roofline_ms']:5.1f} ms = "
            f"{c['roofline_fraction']:.0%})  fp32 packed {c['fp32_packed_ms']:7.1f} ms "
            f"({c['fp32_gb_s']:5.1f} GB/s)  {c['speedup_vs_fp32']:.2f}x"
        )
    if a.json is not None:
        from duetime.metrics import write_json

        write_json(a.json, fig)


if __name__ == "__main__":
    main()
