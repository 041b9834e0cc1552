"""Where a loaded model's kernels change with a step's row count: its cost regimes.

The step-cost model prices each regime as its own band
(:mod:`duetime.core.cost_bands`). The edges are read off the objects the model
runs (each :class:`~duetime.engine.linear.Q8Linear`'s ``max_rows``, the decode
loop's, the output layer's int4 and int8 ranking limits), not restated, so a
changed limit moves the bands with it. A new row-count switch must be added
here: ``tests/test_cost_regimes_guard.py`` times nothing but traces which code
each row count runs, and fails when two row counts in one band take different paths.
"""

from __future__ import annotations

from duetime.core.attention_shape import AttentionShape
from duetime.core.cost_bands import CostRegimes
from duetime.engine import attention
from duetime.engine.decode_loop import MANY_ROWS
from duetime.engine.gemma3 import Gemma3
from duetime.engine.linear import ByRows, Q8Linear
from duetime.engine.rescored_head import RescoredInt8Head

__all__ = [
    "attention_shape_of", "attention_shape_of_any", "regimes_of", "regimes_of_any",
    "traced_paths", "unpriced_switches",
]  # fmt: skip


def regimes_of_any(model: object) -> CostRegimes | None:
    """:func:`regimes_of` for our engine, None for any other model (stand-ins have none)."""
    return regimes_of(model) if isinstance(model, Gemma3) else None


def regimes_of(model: Gemma3) -> CostRegimes:
    """The row-count edges at which ``model``'s layer and output-layer kernels change."""
    rows: set[int] = set()
    for layer in model.layers:
        for product in (layer.qkv, layer.o, layer.gate_up, layer.down):
            if isinstance(product, Q8Linear):
                rows.add(product.max_rows)
    loop = model._loop if model.decode_loop else None
    if loop is not None and loop.max_rows < MANY_ROWS:
        rows.add(loop.max_rows)
    head_rows: set[int] = set()
    head = model.lm_head
    if isinstance(head, RescoredInt8Head):
        if head.coarse_enabled:
            head_rows.add(head.coarse_rows)
        rank = head._int8
        if isinstance(rank, Q8Linear):
            head_rows.add(rank.max_rows)
            rank = rank.fallback
        if isinstance(rank, ByRows):
            head_rows.add(rank.max_rows)
    return CostRegimes(
        rows=tuple(sorted(rows)), head_rows=tuple(sorted(head_rows)),
        attention=attention_shape_of(model),
    )  # fmt: skip


def attention_shape_of_any(model: object) -> AttentionShape | None:
    """:func:`attention_shape_of` for our engine, None for any other model (priced dense)."""
    return attention_shape_of(model) if isinstance(model, Gemma3) else None


def attention_shape_of(model: Gemma3) -> AttentionShape:
    """Where ``model``'s prompt attention changes kernel: its window, its sliding layers,
    and the block a long chunk is cut into (:func:`~duetime.engine.attention.attend_prefill`)."""
    cfg = model.config
    # without blocks a chunk is one call, however long: no chunk outgrows the context
    block = attention.PREFILL_BLOCK if model.blocked_prefill_attention else None
    return AttentionShape(
        window=cfg.sliding_window, sliding_layers=sum(cfg.sliding_layers),
        layers=cfg.num_layers, block=block or cfg.max_position_embeddings,
    )  # fmt: skip


#: Modules whose calls depend on memory and bookkeeping, not on a kernel choice: the KV
#: store grows its buffers when a step crosses its capacity, whatever the rows.
_NOT_KERNELS = ("duetime.engine.kv_store", "duetime.engine.kv_cache")


def traced_paths(model: Gemma3, decoders: int, prompt: int = 0) -> frozenset[str]:
    """The engine functions one greedy step of ``decoders`` decoding sequences (context 6)
    plus, with ``prompt > 0``, one prompt chunk of that many tokens calls.

    Why a trace: a kernel switch shows up as different code running, whatever the
    timings on the machine that runs the test; two row counts that run the same code
    cost the same per row.
    """
    import sys
    from types import FrameType
    from typing import Any

    from duetime.engine.batch import SeqChunk

    kv = model.new_kv_cache()
    slots = [kv.allocate(64) for _ in range(decoders)]
    if slots:
        model.step([SeqChunk(s, [5] * 6, 0) for s in slots], kv)
    chunks = [SeqChunk(s, [7], kv.seq_len(s)) for s in slots]
    if prompt:
        chunks.append(SeqChunk(kv.allocate(64), [9] * prompt, 0))
    seen: set[str] = set()

    def record(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            mod = str(frame.f_globals.get("__name__", ""))
            if mod.startswith("duetime.engine") and not mod.startswith(_NOT_KERNELS):
                seen.add(f"{mod}.{frame.f_code.co_qualname}")

    sys.setprofile(record)
    try:
        model.greedy_step(chunks, kv)
    finally:
        sys.setprofile(None)
    loop = model._loop
    if loop is not None and not prompt and "duetime.engine.decode_loop.DecodeLoop.run" in seen:
        # the C++ loop's own switch (int8 kernel up to few_rows, packed bf16 beyond),
        # which no Python call shows
        seen.add(f"duetime_loop.decode_layers[{'few' if decoders <= loop.few_rows else 'many'}]")
    return frozenset(seen)


def unpriced_switches(
    model: Gemma3, regimes: CostRegimes, max_rows: int = 24, prompt: int = 3
) -> list[str]:
    """Row counts the cost model prices alike although the engine runs different code.

    Steps of 1..``max_rows`` decoders, alone and beside a ``prompt``-token chunk, are
    traced (:func:`traced_paths`); within each cell of the model (rows band, output
    rows band, prompt or not) every step must run the same functions. Each message
    names the two steps and the functions only one of them ran. Empty: every switch
    the engine has within the range is a band edge of ``regimes``.
    """
    from duetime.core.cost_bands import band_index, step_rows

    first: dict[tuple[int, int, bool], tuple[int, frozenset[str]]] = {}
    problems: list[str] = []
    for with_prompt in (False, True):
        for d in range(1, max_rows + 1):
            p = prompt if with_prompt else 0
            rows, head = step_rows(p, d)
            cell = (
                band_index(regimes.edges("rows"), rows),
                band_index(regimes.edges("head_rows"), head),
                with_prompt,
            )
            paths = traced_paths(model, d, p)
            if cell not in first:
                first[cell] = (d, paths)
                continue
            d0, paths0 = first[cell]
            if paths != paths0:
                only = sorted(paths ^ paths0)
                what = "beside a prompt chunk" if with_prompt else "alone"
                problems.append(
                    f"{d0} and {d} decoders {what} run different code ({', '.join(only)}) "
                    f"but the cost model prices them in one band: add the row count where "
                    f"the engine switches to duetime.engine.cost_regimes.regimes_of"
                )
                first[cell] = (d, paths)
    return problems
