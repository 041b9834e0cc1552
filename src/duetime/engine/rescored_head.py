"""The output layer for greedy and top-k decoding: an approximate product ranks the
vocabulary, and each row's best candidates are scored again exactly.

Why: the tied 262,144 x 640 output layer is the largest product of a decode step,
and a step that only takes each row's arg-max (or samples among its top few) needs
exact values only where they decide. An int8 (or int4) product ranks the whole
vocabulary at a quarter (an eighth) of the fp32 bytes, and a gather of the ``k``
best rows of the fp32 weight scores those exactly.
"""

from __future__ import annotations

import torch

from duetime.engine.linear import Int8Linear, Linear, ranking, weight_bytes_read
from duetime.engine.q4_rank import Q4_RANK_MAX_ROWS, Q4Weight, q4_linear

__all__ = ["RescoredInt8Head", "topk_indices"]


class RescoredInt8Head:
    """Int8 output layer whose ``k`` best logits per row are recomputed in fp32.

    The int8 product ranks the vocabulary (a quarter of the fp32 bytes, ~3x
    faster at one row); the ``k`` top candidates of each row are then scored
    exactly against the fp32 ``weight`` (a ``[k, hidden]`` gather per row) and
    written back. The arg-max (and any top-k ≤ ``k`` sampler) therefore sees
    fp32 values unless the true best token falls outside the int8 top ``k``;
    logits outside the candidates stay int8 approximations.

    ``rank``: the approximate product that ranks the vocabulary (default: fbgemm
    :class:`Int8Linear`; ``q8`` passes a :class:`Q8Linear`).

    ``coarse``: an int4 copy of the weight (:mod:`duetime.engine.q4_rank`) that
    ranks instead when the caller reads only each row's arg-max
    (``argmax_only``) and the step has at most ``coarse_rows`` rows; its top
    ``coarse_k`` (64) are re-scored, and the logits outside them are int4
    approximations. ``coarse_enabled = False`` keeps the int8 ranking always.
    """

    def __init__(
        self,
        weight: torch.Tensor,
        k: int = 32,
        *,
        rank: Linear | None = None,
        coarse: Q4Weight | None = None,
        coarse_rows: int = Q4_RANK_MAX_ROWS,
        coarse_k: int = 64,
    ) -> None:
        self.weight = weight.detach().float().contiguous()
        self._int8: Linear = rank if rank is not None else Int8Linear(self.weight)
        self.k = min(k, self.weight.shape[0])
        self.coarse = coarse
        self.coarse_rows = coarse_rows
        self.coarse_k = min(coarse_k, self.weight.shape[0])
        self.coarse_enabled = coarse is not None
        self.dtype = torch.float32
        self.out_features = self.weight.shape[0]
        self.nbytes = self._int8.nbytes  # + k fp32 rows per token, negligible

    def _coarse_for(self, rows: int, argmax_only: bool) -> Q4Weight | None:
        if argmax_only and self.coarse_enabled and rows <= self.coarse_rows:
            return self.coarse
        return None

    def bytes_read(self, rows: int, argmax_only: bool = False) -> int:
        """Weight bytes a product over ``rows`` rows reads (for rooflines)."""
        coarse = self._coarse_for(rows, argmax_only)
        return coarse.nbytes if coarse is not None else weight_bytes_read(self._int8, rows)

    def __call__(self, x: torch.Tensor, *, argmax_only: bool = False) -> torch.Tensor:
        x = x.float()
        coarse = self._coarse_for(x.shape[0], argmax_only)
        if coarse is not None:
            logits, k = q4_linear(x, coarse), self.coarse_k
        else:
            logits, k = self._int8(x), self.k
        idx, exact = self._rescored(x, logits, k)
        return logits.scatter_(1, idx, exact)

    def best(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's greedy token, ``[n]`` int64: the best of its candidates scored exactly.

        For a caller that takes only the arg-max: the ranking product is not rescaled
        (:func:`~duetime.engine.linear.ranking`), and the exact scores are not written
        back into a ``[n, vocab]`` row for an arg-max to read again: two passes over
        the whole product fewer than ``__call__(x, argmax_only=True).argmax(-1)``
        (96 MiB at 96 rows). The candidates are ranked as there (int4 for few rows);
        where an exact score falls below an approximate one outside the candidates,
        the best candidate still wins here, as only exact values are compared.
        """
        x = x.float()
        coarse = self._coarse_for(x.shape[0], True)
        if coarse is not None:
            values, k = q4_linear(x, coarse), self.coarse_k
        else:
            values, k = ranking(self._int8, x), self.k
        idx, exact = self._rescored(x, values, k)
        return idx.gather(1, exact.argmax(1, keepdim=True))[:, 0]

    def _rescored(
        self, x: torch.Tensor, values: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's ``k`` best columns of ``values`` ``[n, k]`` and their exact fp32 logits."""
        idx = topk_indices(values, k)
        return idx, torch.bmm(self.weight[idx], x[:, :, None])[:, :, 0]


_TOPK_GROUP = 128


def topk_indices(logits: torch.Tensor, k: int, group: int = _TOPK_GROUP) -> torch.Tensor:
    """Indices ``[n, k]`` of each row's ``k`` largest values (unordered), via group maxima.

    ``torch.topk`` over 262,144 logits took 5.2 ms for 16 rows here; this takes
    0.8 ms: each row is cut into groups of ``group`` values, the ``k`` groups
    with the largest maxima are kept, and ``topk`` runs over their ``k·group``
    values only. Exact: a value among the row's top ``k`` has at most ``k − 1``
    larger values, so at most ``k − 1`` groups have a larger maximum than its
    group's, which is therefore among the top ``k`` groups (ties between equal
    values may pick a different but equal-valued index). Rows whose length is
    not a multiple of ``group`` (tiny test vocabularies) use ``torch.topk``.
    """
    n, v = logits.shape
    if v % group or v // group < k:
        return logits.topk(k, dim=-1, sorted=False).indices
    blocks = logits.view(n, v // group, group)
    top_groups = blocks.amax(-1).topk(k, dim=-1, sorted=False).indices  # [n, k]
    cand = blocks.gather(1, top_groups[:, :, None].expand(n, k, group)).view(n, k * group)
    inner = cand.topk(k, dim=-1, sorted=False).indices  # [n, k] into the candidates
    return top_groups.gather(1, inner // group) * group + inner % group
