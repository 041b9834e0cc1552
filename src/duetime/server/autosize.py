"""The server's batch limits from its own step costs: the largest batch that meets a TPOT.

A running batch trades each stream's pace for the server's throughput: a decode
step of D sequences costs about ``c + b·D + d·KV`` (the simulator's batch model,
KV the tokens attended), so more sequences mean more tokens a second in all and
a slower token for each. A fixed limit is right for one machine only (the same
32 sequences took 126 ms a step on one day and 70 on another here). So at start
the server times a few steps of its own model, fits that model, and takes:

- ``max_num_seqs``: the largest D whose decode step, at ``context`` tokens a
  sequence, still meets ``tpot_target_s`` (vLLM's ``max_num_seqs``);
- ``max_batch_tokens``: the largest prefill chunk (a multiple of 64) that a step
  of ``max_num_seqs`` decoders can carry while that step stays within twice the
  target: the decoders wait for a chunk's step, so the chunk sets the worst
  token gap a stream sees while others' prompts are computed.

A given ``--profile`` (a fitted cost model) stands in for the timing. The limits
and the figures they came from are shown in ``/health`` and ``/v1/models``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from duetime.core.cost import LinearStepCost

if TYPE_CHECKING:
    from duetime.server.build import ServeOptions

__all__ = ["ServeLimits", "limits_from_cost", "measure_step_cost", "size_options"]

log = logging.getLogger("duetime.server")

#: The pace auto sizing keeps a stream at: 5 tokens a second, about reading speed. At
#: 100 ms (the first default) Gemma q8 ran 7-14 sequences on 2 cores, and `vllm bench
#: serve` at 1 request/s (256 in / 128 out) queued its requests for a median TTFT of
#: 12 s, against 0.37 s for vLLM CPU in the same run (docs/results.md#serve-peers).
DEFAULT_TPOT_TARGET_MS = 200.0
#: The batch limit is never set above this (the executor's KV and the policies'
#: per-step work grow with it) nor below 1.
MAX_SEQS_CAP = 256
#: Prefill chunks are multiples of this, between one and 32 of them.
CHUNK_UNIT = 64
MAX_CHUNK = 2048


@dataclass(slots=True, frozen=True)
class ServeLimits:
    """What the server runs with, and why."""

    max_num_seqs: int
    max_batch_tokens: int
    tpot_target_ms: float
    context_tokens: int
    #: The model's decode step at ``max_num_seqs`` and the chunk step, ms (None: given).
    decode_step_ms: float | None
    chunk_step_ms: float | None
    #: "measured at start", "profile", or "given" (both limits set by hand).
    source: str
    cost: dict[str, float] | None

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def limits_from_cost(
    cost: LinearStepCost,
    *,
    tpot_target_s: float,
    context: int,
    source: str,
    seqs: int | None = None,
    chunk: int | None = None,
) -> ServeLimits:
    """The limits the module describes, under the batch cost model ``cost``; ``seqs`` or
    ``chunk`` given are kept (the figures are then those of the limits kept)."""
    if not tpot_target_s > 0:
        raise ValueError(f"the TPOT target must be > 0, got {tpot_target_s}")
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")

    def decode(d: int) -> float:
        return cost.c0 + cost.b * d + cost.d * d * context

    if seqs is None:
        seqs = 1
        while seqs < MAX_SEQS_CAP and decode(seqs + 1) <= tpot_target_s:
            seqs += 1
    base = decode(seqs)
    if chunk is None:
        chunk = CHUNK_UNIT
        while chunk < MAX_CHUNK and base + cost.a1 * (chunk + CHUNK_UNIT) <= 2 * tpot_target_s:
            chunk += CHUNK_UNIT
    return ServeLimits(
        max_num_seqs=seqs,
        max_batch_tokens=chunk,
        tpot_target_ms=1000 * tpot_target_s,
        context_tokens=context,
        decode_step_ms=1000 * base,
        chunk_step_ms=1000 * (base + cost.a1 * chunk),
        source=source,
        cost={
            "c_s": cost.c0,
            "per_prefill_token_s": cost.a1,
            "per_decoder_s": cost.b,
            "per_kv_token_s": cost.d,
        },
    )


def measure_step_cost(
    model: Any,
    *,
    batches: tuple[int, ...] = (1, 16, 64),
    short: int = 32,
    long: int = 512,
    long_batch: int = 8,
    reps: int = 3,
) -> LinearStepCost:
    """Time the model's own steps and fit ``c + a·P + b·D + d·KV`` (seconds).

    Each batch in ``batches`` is prefilled with ``short``-token prompts in one step
    (the prefill rows: ``a``), then decodes ``reps`` steps (``c``, ``b``); one batch of
    ``long_batch`` sequences at ``long`` tokens gives the cost of the KV attended
    (``d``). A first, untimed cell warms the kernels up (their first call builds or
    loads them).
    """
    from duetime.engine.batch import SeqChunk

    rows: list[tuple[float, int, int, int]] = []  # seconds, P, D, KV
    g = np.random.default_rng(0)
    vocab = model.config.vocab_size
    bos = model.config.bos_token_id

    def prompt(n: int) -> list[int]:
        return [bos, *(int(t) for t in g.integers(min(3, vocab - 1), vocab, n - 1))]

    cells = [(1, short)] + [(b, short) for b in batches] + [(long_batch, long)]
    for i, (batch, length) in enumerate(cells):
        kv = model.new_kv_cache()
        slots = [kv.allocate() for _ in range(batch)]
        chunks = [SeqChunk(s, prompt(length), 0) for s in slots]
        t0 = time.perf_counter()
        model.step(chunks, kv, argmax_only=True)
        rows.append((time.perf_counter() - t0, batch * length, 0, 0))
        for _ in range(reps):
            attended = sum(kv.seq_len(s) + 1 for s in slots)
            step = [SeqChunk(s, [100], kv.seq_len(s)) for s in slots]
            t0 = time.perf_counter()
            model.step(step, kv, argmax_only=True)
            rows.append((time.perf_counter() - t0, 0, batch, attended))
        for s in slots:
            kv.free(s)
        if i == 0:
            rows.clear()  # the warm-up
    return _fit(rows)


def _fit(rows: list[tuple[float, int, int, int]]) -> LinearStepCost:
    """``c``, ``b``, ``d`` from the decode steps alone (non-negative least squares), then
    ``a`` from the prefill steps less ``c``: one fit over both lets the long prefill
    steps' residuals swamp the decode steps' few milliseconds, which the limits rest on."""
    from scipy.optimize import nnls

    dec = [r for r in rows if r[1] == 0]
    pre = [r for r in rows if r[1] > 0]
    y = np.array([r[0] for r in dec])
    x = np.array([[1.0, r[2], r[3]] for r in dec])
    scale = np.maximum(np.abs(x).max(axis=0), 1e-12)
    coef, _ = nnls(x / scale, y)
    c, b, d = (float(v) for v in coef / scale)
    a = float(np.median([max(r[0] - c, 0.0) / r[1] for r in pre])) if pre else 0.0
    return LinearStepCost.batch(c=c, a=a, b=max(b, 1e-6), d=d)


def size_options(
    options: ServeOptions,
    model: Any,
    *,
    auto_seqs: bool,
    auto_tokens: bool,
    tpot_target_s: float,
    context: int,
) -> ServeLimits:
    """Set ``options``' batch limits as the module says and return how they were chosen:
    what is auto (``auto_seqs``, ``auto_tokens``) comes from the model's steps, timed
    now, or from ``options.profile``'s cost model; a number given stays as given."""
    if not (auto_seqs or auto_tokens):
        return ServeLimits(
            max_num_seqs=options.max_num_seqs,
            max_batch_tokens=options.max_batch_tokens,
            tpot_target_ms=1000 * tpot_target_s,
            context_tokens=context,
            decode_step_ms=None,
            chunk_step_ms=None,
            source="given",
            cost=None,
        )
    if options.profile is not None:
        cost, source = LinearStepCost.from_profile(options.profile), "profile"
    else:
        log.info("timing the model's steps to size its batches")
        cost, source = measure_step_cost(model), "measured at start"
        options.measured_cost = cost
    if not (auto_seqs and auto_tokens):
        source = f"{source}, partly given"
    limits = limits_from_cost(
        cost,
        tpot_target_s=tpot_target_s,
        context=context,
        source=source,
        seqs=None if auto_seqs else options.max_num_seqs,
        chunk=None if auto_tokens else options.max_batch_tokens,
    )
    options.max_num_seqs = limits.max_num_seqs
    options.max_batch_tokens = limits.max_batch_tokens
    return limits
