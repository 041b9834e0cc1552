"""Dynamic int8 linear through oneDNN (AMX tiles, or AVX-512 VNNI): the output layer's
ranking product for steps of many rows.

Why: the tied 262,144 x 640 output layer is the largest product of a decode step.
fbgemm's int8 GEMM (:class:`~duetime.engine.linear.Int8Linear`) runs it on AVX-512
VNNI; oneDNN's int8 matmul runs it faster from about a dozen rows, on AMX tiles where
the CPU has them and on VNNI where it has not. On the 2-core Xeon (AMX), 64 rows took
10-21 ms here against fbgemm's 47-60 ms, and 16 rows 10 ms against 17-21 ms
(interleaved medians; the table: docs/results.md#engine-head-rows). On the 2-core EPYC
(Zen 4, VNNI, no AMX), a whole greedy decode step of Gemma 3 270M q8 took 0.906x
fbgemm's at 96 sequences, 0.963x at 32 and 0.994x at 16 (steps of two models
interleaved in one process, docs/results.md#engine-head-onednn-vnni), and its ranking
matched the fp32 arg-max on 96 of 96 random-prompt rows against fbgemm's 94.

The activation is scaled per row, as :class:`~duetime.engine.linear.Int8Linear` does
(one outlier token would otherwise crush every other row's levels), and quantised to
unsigned 8 bits around 128 with the full 7-bit range each side: neither AMX nor VNNI's
``vpdpbusd`` saturates a pair of products as ``vpmaddubsw`` does, so no
``reduce_range``. The weight is int8 per output channel, packed once at load by
``onednn::qlinear_prepack``.
"""

from __future__ import annotations

import torch

from duetime.engine.linear import ByRows, Int8Linear, Linear, RowScaledInt8

__all__ = ["ONEDNN_HEAD_MIN_ROWS", "OneDnnInt8Linear", "int8_rank", "onednn_int8_available"]

# Rows from which the output layer's ranking product takes oneDNN's int8 kernel instead
# of fbgemm's (AMX or VNNI): 2-core Xeon with AMX, 262,144 x 640, ms per product,
# fbgemm / oneDNN, interleaved medians: 2 rows 10.8 / 16.2, 8 rows 13.8 / 15.9,
# 12 rows 16.5 / 15.9, 16 rows 18.5 / 16.2, 32 rows 29.9 / 19.8, 64 rows 52.9 / 29.4.
ONEDNN_HEAD_MIN_ROWS = 12

# The row count oneDNN packs the weight for; 1, 16 and 64 measured alike at 3-64 rows.
_PACK_HINT_ROWS = 16


def onednn_int8_available() -> bool:
    """Whether this torch build has oneDNN's int8 linear and the CPU has AMX tiles or
    VNNI (without either, oneDNN would fall back to ``vpmaddubsw``, which saturates)."""
    ops = getattr(torch.ops, "onednn", None)
    if ops is None or not hasattr(ops, "qlinear_pointwise"):
        return False
    cpu = torch.cpu
    amx = bool(getattr(cpu, "_is_amx_tile_supported", lambda: False)())
    return amx or bool(getattr(cpu, "_is_vnni_supported", lambda: False)())


class OneDnnInt8Linear(RowScaledInt8):
    """``y = x @ W.T`` with an int8 per-channel weight and per-row int8 activations;
    fp32 in and out."""

    def __init__(self, weight: torch.Tensor) -> None:
        w = weight.detach().float()
        scales = (w.abs().amax(dim=1).clamp_min(1e-8) / 127.0).contiguous()
        w8 = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        self._packed = torch.ops.onednn.qlinear_prepack(w8, [_PACK_HINT_ROWS, w.shape[1]])
        self._scales = scales
        self._zeros = torch.zeros(w.shape[0], dtype=torch.int64)
        self.dtype = torch.float32
        self.out_features = w.shape[0]
        self.nbytes = w.numel() + 4 * w.shape[0]  # int8 weight + one scale per row

    def _product(self, x: torch.Tensor, row_max: torch.Tensor) -> torch.Tensor:
        qx = x.mul(127.0 / row_max).round_().add_(128.0).to(torch.uint8)
        return torch.ops.onednn.qlinear_pointwise(
            qx, 1.0 / 127.0, 128, self._packed, self._scales, self._zeros,
            None, 1.0, 0, torch.float32, "none", [], "",
        )  # fmt: skip


def int8_rank(weight: torch.Tensor) -> Linear:
    """The output layer's int8 ranking product: fbgemm's, and oneDNN's from
    :data:`ONEDNN_HEAD_MIN_ROWS` rows where the CPU has AMX or VNNI (one more int8 copy
    of the weight, 168 MB for Gemma 3 270M, for a step of 64 rows ~1.8x faster to rank
    on AMX, a 96-sequence greedy step 0.91x on VNNI: the module docstring)."""
    fbgemm = Int8Linear(weight)
    if not onednn_int8_available():
        return fbgemm
    return ByRows(fbgemm, OneDnnInt8Linear(weight), ONEDNN_HEAD_MIN_ROWS - 1)
