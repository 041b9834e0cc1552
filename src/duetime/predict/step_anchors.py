"""Steps a window of served steps has not seen, priced by the model known before.

Why: the server refits its step-cost model to its last 256 steps, and a band or
knot no step fell in prices nothing. After a quiet minute of one-sequence decodes
the window held 250 one-row steps and a few prompt chunks: the fit priced a
100-token prompt at 3 ms (it takes ~80) and put every prompt row past 256 at
10 ms, so a 1,667-token prompt was forecast at 6.1 s against the 2.4 s it took.
The fit therefore also sees *anchors*: a fixed set of step shapes (decode
batches, prompts alone, a chunk with context behind it, mixed steps) for each
cell of the model the window has too few steps in, priced by the prior (a given
profile, or the steps timed at start) scaled by how the window's steps ran
against it. Where the window has steps, they decide; where it has none, the
prior does, at today's speed.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from duetime.core.cost import LinearStepCost, chunk_attention
from duetime.core.cost_bands import CostRegimes, band_index, step_rows
from duetime.predict.ete import ROW_KNOTS, StepSample, priced_seconds, step_kind

__all__ = ["ANCHOR_SHAPES", "anchor_samples"]

#: (prompt tokens, their past, decoders, context a decoder holds): the shapes anchors
#: are drawn from, every kernel band and knot of Gemma q8 covered twice or more.
ANCHOR_SHAPES: tuple[tuple[int, int, int, int], ...] = (
    *((0, 0, d, 256) for d in (1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256)),
    *((p, 0, 0, 0) for p in (4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)),
    (256, 256, 0, 0), (256, 768, 0, 0),
    (32, 0, 2, 256), (64, 0, 4, 256), (128, 0, 16, 256), (256, 0, 32, 256), (192, 0, 96, 256),
)  # fmt: skip
#: Window steps a cell needs before its anchors are left out.
SEEN = 3
#: The window's speed against the prior is taken within these bounds.
SCALE_BOUNDS = (0.5, 2.0)


def _cell(
    row_edges: tuple[int, ...], head_edges: tuple[int, ...], prefill: int, decoders: int
) -> tuple[int, int, bool]:
    rows, head = step_rows(prefill, decoders)
    return band_index(row_edges, rows), band_index(head_edges, head), prefill > 0


def _sample(
    cost: LinearStepCost, shape: tuple[int, int, int, int], scale: float, regimes: CostRegimes
) -> StepSample:
    """An anchor step: priced by ``cost``, its attention written as the fit's samples
    write theirs (``regimes.attention``, the engine's kernels)."""
    p, past, d, ctx = shape
    seconds = scale * cost.step_time(p, cost.chunk_attention(p, past + p), d, d * ctx)
    attn = chunk_attention(p, past + p, regimes.attention)
    return StepSample(p, attn, d, d * ctx, seconds, step_kind(p, d))


def anchor_samples(
    prior: LinearStepCost, window: Sequence[StepSample], regimes: CostRegimes
) -> list[StepSample]:
    """Anchor steps for the cells of ``regimes`` (and the fit's knots) that ``window``
    has fewer than :data:`SEEN` steps in, priced by ``prior`` times the window's
    measured seconds over the prior's (bounded by :data:`SCALE_BOUNDS`)."""
    priced = float(priced_seconds(prior, window).sum())
    measured = sum(s.seconds for s in window)
    scale = measured / priced if priced > 0 and measured > 0 else 1.0
    scale = min(max(scale, SCALE_BOUNDS[0]), SCALE_BOUNDS[1])
    edges = (tuple(sorted({*regimes.edges("rows"), *ROW_KNOTS})), regimes.edges("head_rows"))
    seen = Counter(_cell(*edges, s.prefill_tokens, s.decode_seqs) for s in window)
    return [
        _sample(prior, shape, scale, regimes)
        for shape in ANCHOR_SHAPES
        if seen[_cell(*edges, shape[0], shape[2])] < SEEN
    ]
