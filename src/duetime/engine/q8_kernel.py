"""Weight-only int8 GEMV / small GEMM for AVX2, compiled on first use.

Why our own kernel: batch-1 decode is memory-bound (fp32 reads 1.07 GB of
weights per token), so only fewer bytes per weight can speed it up, and this
torch build has no fast weight-only int8 kernel on AVX2
(``torch._weight_int8pack_mm`` measured 5-60x *slower* than fp32 here) while
fbgemm's dynamic int8 quantises activations too (77 % top-1 agreement on the
real model). This kernel keeps activations and accumulation in fp32 and only
stores weights as int8 with one fp32 scale per output row:

    y[m, n] = s[n] · Σ_k W8[n, k] · x[m, k]

Each 8 int8 weights are widened with ``vpmovsxbd`` + ``vcvtdq2ps`` and fed to
FMAs; up to 4 output rows share each load of ``x`` (1-4 rows of ``x`` per tile,
at most 8 accumulators so none spill; more rows reuse the weight block from
L1), and output rows are split across
threads with ``at::parallel_for``. A fixed summation order per row makes the
result independent of the thread count.

The C++ is built on first use by :class:`~duetime.engine.cpp_ext.CppOps`
(g++ and ninja; ``-O3 -mavx2 -mfma -mf16c``; cached per source hash). When the
CPU lacks AVX2 or the build fails (no compiler), :func:`q8_ops` logs one
warning and returns ``None``; callers then keep the fp32 path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from duetime.engine.cpp_ext import CppOps

__all__ = [
    "PackedWeight",
    "Q8Weight",
    "build_dir",
    "q8_available",
    "q8_linear",
    "q8_ops",
    "quantize_q8",
]

log = logging.getLogger(__name__)


_EXT = CppOps(
    "duetime_q8", "q8_kernel.cpp", what="int8 weight-only kernel", env="DUETIME_Q8", logger=log
)


def build_dir() -> Path:
    """Where the compiled kernel lives: one folder per (source, flags, torch version)."""
    return _EXT.build_dir()


def q8_ops() -> Any | None:
    """The compiled ops (``.linear(x, w, s, n)``), or ``None`` once a build has failed.

    The first call compiles (seconds) or loads the cached build; a failure is
    logged once as a warning and remembered for the life of the process.
    ``DUETIME_Q8=0`` disables the kernel (the fp32 fallback path is then used).
    """
    return _EXT.ops()


def q8_available() -> bool:
    """Whether the kernel is built (compiles it on the first call)."""
    return q8_ops() is not None


@dataclass(frozen=True)
class PackedWeight:
    """A quantised weight in a kernel's layout: its packed values and their scales."""

    packed: torch.Tensor
    scale: torch.Tensor
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        """Bytes one product reads: packed values plus scales."""
        return self.packed.nbytes + self.scale.nbytes


@dataclass(frozen=True)
class Q8Weight(PackedWeight):
    """An int8 weight in the kernel's layout, with one fp32 scale per output row.

    ``packed``: ``[ceil(out/4), in8/8, 4, 8]`` int8 — blocks of 4 output rows
    interleaved 8 columns at a time, so the kernel reads one sequential stream
    per block (``in8``: ``in`` rounded up to 8, zero padded; padded rows are
    zero too). ``scale``: ``[ceil(out/4) * 4]`` fp32.
    """

    def int8(self) -> torch.Tensor:
        """The plain ``[out, in]`` int8 matrix (for tests and references; a copy)."""
        blocks, k8 = self.packed.shape[:2]
        plain = self.packed.permute(0, 2, 1, 3).reshape(blocks * 4, k8 * 8)
        return plain[: self.out_features, : self.in_features].contiguous()

    def dequantize(self) -> torch.Tensor:
        """``W8 * scale`` as fp32 ``[out, in]``: the weight the kernel multiplies by."""
        return self.int8().float() * self.scale[: self.out_features, None]


def quantize_q8(weight: torch.Tensor) -> Q8Weight:
    """Symmetric per-output-channel int8 in the kernel's packed layout.

    ``scale = max|row| / 127`` and ``W8 = round(W / scale)`` (error ≤ scale/2 per
    entry). Done in row chunks to keep the transient fp32 copy small.
    """
    if weight.dim() != 2:
        raise ValueError(f"quantize_q8 wants a 2-D [out, in] weight, got {tuple(weight.shape)}")
    w = weight.detach()
    n, k = w.shape
    n4, k8 = -(-n // 4) * 4, -(-k // 8) * 8
    plain = torch.zeros((n4, k8), dtype=torch.int8)
    scale = torch.ones(n4, dtype=torch.float32)
    step = max(4, ((1 << 22) // max(k, 1)) // 4 * 4)
    for a in range(0, n, step):
        rows = w[a : a + step].float()
        s = rows.abs().amax(dim=1).clamp_min(1e-30) / 127.0
        plain[a : a + len(rows), :k] = (
            torch.round(rows / s[:, None]).clamp_(-127, 127).to(torch.int8)
        )
        scale[a : a + len(rows)] = s
    packed = plain.view(n4 // 4, 4, k8 // 8, 8).permute(0, 2, 1, 3).contiguous()
    return Q8Weight(packed, scale, n, k)


def q8_linear(x: torch.Tensor, w: Q8Weight) -> torch.Tensor:
    """``x @ w.dequantize().T`` in fp32 through the kernel (which must be built)."""
    ops = q8_ops()
    if ops is None:
        raise RuntimeError("the int8 kernel is not available (see the warning logged earlier)")
    return ops.linear(x, w.packed, w.scale, w.out_features)
