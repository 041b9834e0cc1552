"""Int4 ranking of the vocabulary for steps that read only each row's arg-max.

Why: at batch 1 the output layer is most of the bytes a decode step reads
(Gemma 3 270M: 262,144 x 640, 168 MB in int8 against 103 MB for all the
layers), and a decode step is bound by memory. Greedy decoding reads just one
token per row, and the output layer already re-scores its top candidates in
fp32 (:class:`~duetime.engine.rescored_head.RescoredInt8Head`), so the ranking that
picks those candidates may be coarser: int4 halves its bytes. On Gemma's real
final hidden states (1,920 positions of ShareGPT prompts and answers) the fp32
arg-max was inside the int4 top 64 at every position, and so were the fp32 top
5; the logits *outside* the re-scored candidates are what int4 spoils (KL to
fp32 0.017 nats against 0.0001 for the int8 ranking), so a step whose rows
sample, follow a grammar or log probabilities keeps the int8 ranking
(``argmax_only`` in :meth:`~duetime.engine.gemma3.Gemma3.step`).

Layout: groups of ``GROUP`` = 64 input columns, one fp16 scale per (row,
group), symmetric 4-bit values ``q`` in [-8, 7] stored as ``q + 8``; in a
group's 32 bytes, byte ``j`` holds column ``j`` in its low nibble and column
``j + 32`` in its high one, so two masks and a shift unpack a group into two
vectors of 32 unsigned bytes. Activations are quantised to int8 per row
(symmetric, like fbgemm's dynamic int8), and the kernel multiplies with
AVX-512 VNNI's ``vpdpbusd`` (unsigned x signed bytes, summed into int32):

    y[m, n] = sx[m] · Σ_g s[n, g] · (Σ_j (q[n, j] + 8) · xq[m, j] − 8 · Σ_j xq[m, j])

the ``− 8 · Σ xq`` of each group starts its accumulator, so it costs nothing
inside the loop. At 1-2 rows the product streams the 89 MB at the memory's
speed (2.0-2.4 ms here against 3.8-5.0 ms for the int8 kernel) and it beats
fbgemm's int8 GEMM up to 6 rows (4.4 vs 5.6 ms), but in the engine the gain
stopped at 5-6 rows, so :data:`Q4_RANK_MAX_ROWS` is 4 (docs/results.md#engine-q4-rank).

The kernel needs AVX-512 with VNNI (checked at run time, the source is built
with per-function targets); elsewhere, or when the build fails or
``DUETIME_Q4=0``, :func:`q4_available` is False and the model keeps its int8
ranking.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from duetime.engine.cpp_ext import CppOps
from duetime.engine.q8_kernel import PackedWeight

__all__ = [
    "GROUP",
    "Q4_RANK_MAX_ROWS",
    "Q4Weight",
    "q4_available",
    "q4_linear",
    "q4_ops",
    "quantize_q4",
]

log = logging.getLogger(__name__)

GROUP = 64  # input columns per scale
#: Rows up to which the int4 product ranks the vocabulary (2 threads,
#: 262,144 x 640, ms per product, int4 / fbgemm int8: 1 row 2.1 / 4.3, 4 rows 2.8 / 5.1,
#: 6 rows 4.4 / 5.6, 8 rows 6.0 / 6.3; `bench engine` q8 over q8-int8rank: b4 1.09-1.15x,
#: b5 1.02x, b6 0.96-1.01x).
Q4_RANK_MAX_ROWS = 4


_EXT = CppOps("duetime_q4", "q4_rank.cpp", what="int4 ranking kernel", env="DUETIME_Q4", logger=log)


def q4_ops() -> Any | None:
    """The compiled ops (``.linear(x, w, s)``, ``.supported()``), or ``None`` once a
    build has failed or ``DUETIME_Q4=0`` (logged once)."""
    return _EXT.ops()


def q4_available() -> bool:
    """Whether the kernel is built and this CPU runs it (AVX-512 VNNI)."""
    ops = q4_ops()
    return ops is not None and bool(ops.supported())


@dataclass(frozen=True)
class Q4Weight(PackedWeight):
    """A weight in the kernel's int4 layout (see the module docstring).

    ``packed``: ``[out, groups * 32]`` uint8; ``scale``: ``[out, groups]`` fp16,
    ``groups = ceil(in / 64)``; padded columns are zeros.
    """

    def int4(self) -> torch.Tensor:
        """The plain ``[out, in]`` values in [-8, 7] as int8 (tests and references)."""
        n, groups = self.scale.shape
        b = self.packed.view(n, groups, 32).to(torch.int16)
        q = torch.cat([(b & 15) - 8, (b >> 4) - 8], dim=-1).view(n, groups * GROUP)
        return q[:, : self.in_features].to(torch.int8)

    def dequantize(self) -> torch.Tensor:
        """The fp32 ``[out, in]`` weight the kernel multiplies by."""
        n, groups = self.scale.shape
        q = self.int4().float()
        pad = groups * GROUP - self.in_features
        q = torch.nn.functional.pad(q, (0, pad)).view(n, groups, GROUP)
        return (q * self.scale.float()[:, :, None]).view(n, -1)[:, : self.in_features]


def quantize_q4(weight: torch.Tensor) -> Q4Weight:
    """Symmetric int4 per group of 64 columns: ``scale = max|group| / 7`` (rounded to
    fp16 first, so the stored scale is the one the values were rounded with) and
    ``q = clamp(round(w / scale), -8, 7)``. Done in row chunks to bound the copies."""
    if weight.dim() != 2:
        raise ValueError(f"quantize_q4 wants a 2-D [out, in] weight, got {tuple(weight.shape)}")
    w = weight.detach()
    n, k = w.shape
    groups = -(-k // GROUP)
    packed = torch.empty((n, groups * 32), dtype=torch.uint8)
    scale = torch.empty((n, groups), dtype=torch.float16)
    step = max(1, (1 << 20) // max(groups * GROUP, 1))  # ~4 MB transients a chunk
    for a in range(0, n, step):
        rows = torch.nn.functional.pad(w[a : a + step].float(), (0, groups * GROUP - k))
        g = rows.view(len(rows), groups, GROUP)
        s16 = (g.abs().amax(dim=-1) / 7.0).to(torch.float16)
        s = s16.float()
        q = torch.where(s[..., None] > 0, torch.round(g / s[..., None]), 0.0)
        u = (q.clamp_(-8, 7) + 8).to(torch.uint8)  # [rows, groups, 64]
        packed[a : a + len(rows)] = (u[..., :32] | (u[..., 32:] << 4)).view(len(rows), -1)
        scale[a : a + len(rows)] = s16
    return Q4Weight(packed, scale, n, k)


def q4_linear(x: torch.Tensor, w: Q4Weight) -> torch.Tensor:
    """``x @ w.dequantize().T`` through the kernel, activations quantised to int8 per
    row (the kernel must be available: :func:`q4_available`)."""
    ops = q4_ops()
    if ops is None:
        raise RuntimeError("the int4 kernel is not available (see the warning logged earlier)")
    return ops.linear(x.float(), w.packed, w.scale)
