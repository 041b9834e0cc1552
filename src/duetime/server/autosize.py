"""The server's batch limits from its own step costs: the largest batch that meets a TPOT.

A running batch trades each stream's pace for the server's throughput: a decode
step of D sequences costs about ``c + b·D + d·KV`` plus the band of its kernel
regime (the simulator's step-cost model, KV the tokens attended), so more
sequences mean more tokens a second in all and
a slower token for each. A fixed limit is right for one machine only (the same
32 sequences took 126 ms a step on one day and 70 on another here). So at start
the server times a few steps of its own model, fits that model, and takes:

- ``max_num_seqs``: the largest D whose decode step, at ``context`` tokens a
  sequence, still meets ``tpot_target_s`` (vLLM's ``max_num_seqs``);
- the prefill chunk: the largest number of prompt tokens (a multiple of 64) that
  a step of ``max_num_seqs`` decoders can carry while that step stays within
  twice the target: the decoders wait for a chunk's step, so the chunk sets the
  worst token gap a stream sees while others' prompts are computed;
- ``max_batch_tokens``: the step's token budget, ``max_num_seqs`` plus the chunk.
  The budget counts a token for each decoder (vLLM's ``max_num_batched_tokens``
  does the same), so a budget of the chunk alone left a full batch of 100
  decoders 156 of its 256 tokens for prompts, and prompts queued behind it.

A given ``--profile`` (a fitted cost model) stands in for the timing. The limits
and the figures they came from are shown in ``/health`` and ``/v1/models``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from duetime.core.cost import LinearStepCost, chunk_attention

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
#: Steps of one shape timed at start that spread more than this between their repeats
#: (mean absolute deviation from their median, %) were timed on a busy machine, and the
#: limits sized from them are too small: quiet starts of Gemma q8 on machine E spread
#: 4.9 and 5.1 %, one beside two CPU-bound processes 37.8 % (and sized 80 sequences,
#: against 212 and 221 quiet). The limits are still sized from all the repeats, not
#: the fastest of each shape: beside two CPU-bound processes the fastest sized 76, 85
#: and 95 sequences where all sized 33, 87 and 91 (the machine is that much slower
#: while they run), and quiet, the fastest prices a step below its typical time by
#: about the repeats' spread (3.8-7.2 %), sizing past the TPOT target (209-220
#: sequences against 185-214 from all, in four starts).
BUSY_SPREAD_PCT = 15.0
#: Prefill chunks are multiples of this, between one and 32 of them.
CHUNK_UNIT = 64
MAX_CHUNK = 2048


@dataclass(slots=True, frozen=True)
class ServeLimits:
    """The batch limits the server runs with, and why: sized for ``tpot_target_ms`` from
    the model's steps timed at start or a profile, or given by hand."""

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
    #: How much the steps timed at start spread between repeats, % (None: not timed);
    #: past :data:`BUSY_SPREAD_PCT` the machine was busy while they were timed.
    timing_spread_pct: float | None = None

    @property
    def prefill_chunk_tokens(self) -> int:
        """Prompt tokens a step of ``max_num_seqs`` decoders has room for."""
        return max(self.max_batch_tokens - self.max_num_seqs, 0)

    def as_dict(self) -> dict[str, Any]:
        return {**asdict(self), "prefill_chunk_tokens": self.prefill_chunk_tokens}


def limits_from_cost(
    cost: LinearStepCost,
    *,
    tpot_target_s: float,
    context: int,
    source: str,
    seqs: int | None = None,
    budget: int | None = None,
) -> ServeLimits:
    """The limits the module describes, under the batch cost model ``cost``; ``seqs`` or
    ``budget`` (a given ``max_batch_tokens``) are kept, and the figures are then those
    of the limits kept."""
    if not tpot_target_s > 0:
        raise ValueError(f"the TPOT target must be > 0, got {tpot_target_s}")
    if context < 1:
        raise ValueError(f"context must be >= 1 token, got {context}")

    def decode(d: int) -> float:
        return cost.decode_step(d, d * context)

    if seqs is None:
        seqs = 1
        while seqs < MAX_SEQS_CAP and decode(seqs + 1) <= tpot_target_s:
            seqs += 1
        if budget is not None:
            seqs = min(seqs, budget)  # a decoder takes a token of the step's budget
    base = decode(seqs)
    batch = seqs

    def with_chunk(n: int) -> float:  # a first chunk of n prompt tokens beside the decoders
        return cost.prompt_step(n, batch, batch * context)

    if budget is None:
        chunk = CHUNK_UNIT
        while chunk < MAX_CHUNK and with_chunk(chunk + CHUNK_UNIT) <= 2 * tpot_target_s:
            chunk += CHUNK_UNIT
        budget = seqs + chunk
    else:
        chunk = max(budget - seqs, 0)
    return ServeLimits(
        max_num_seqs=seqs,
        max_batch_tokens=budget,
        tpot_target_ms=1000 * tpot_target_s,
        context_tokens=context,
        decode_step_ms=1000 * base,
        chunk_step_ms=1000 * with_chunk(chunk),
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
    batches: tuple[int, ...] = (1, 2, 4, 6, 8, 10, 16, 32, 64, 128),
    context: int = 32,
    prompts: tuple[int, ...] = (64, 256, 512),
    long_cell: tuple[int, int] = (12, 512),
    chunked: tuple[int, int] = (512, 256),
    reps: int = 3,
) -> LinearStepCost:
    """Time the model's own steps and fit the step-cost model ``duetime profile`` fits.

    Each batch in ``batches`` (two or more in each kernel regime of Gemma q8: 1-2,
    3-4, 5-8, 9-11 and 12+ rows, the last where the CPU has AMX or VNNI; 128 so that
    a limit near 100 sequences is read between measured steps, not extrapolated from
    64) is prefilled with
    ``context``-token prompts (untimed), then decodes ``reps`` timed steps; each prompt
    length in ``prompts`` is prefilled alone ``reps`` times. ``long_cell`` (decoders,
    context) decodes at a longer context too: from ``context``-token sequences alone the
    KV term cannot be told from the per-decoder one (the fit put it at 0, and limits sized
    for 512-token contexts ran TPOT p50 at 217-288 ms against a 200 ms target; 12
    decoders, so that the cell runs the many-row kernels). The cell adds ~5 s to the
    start. ``chunked`` (prompt, chunk) prefills one prompt a chunk at a time, so that a
    chunk's attention to the context behind it is measured, not read off whole prompts
    alone. A first, untimed
    cell warms the kernels up (their first call builds or loads them), and each cell's
    first decode is not timed (it ran 10-20 % slower than the next ones). The fit
    (:func:`duetime.predict.ete.fit_batch_cost`) has a band per regime the model reports
    (:func:`duetime.engine.cost_regimes.regimes_of`).
    """
    from duetime.engine.batch import SeqChunk
    from duetime.engine.cost_regimes import regimes_of
    from duetime.predict.cost_report import repeat_floor_pct
    from duetime.predict.ete import StepSample, fit_batch_cost

    regimes = regimes_of(model)
    samples: list[StepSample] = []
    g = np.random.default_rng(0)
    vocab = model.config.vocab_size
    bos = model.config.bos_token_id

    def prompt(n: int) -> list[int]:
        return [bos, *(int(t) for t in g.integers(min(3, vocab - 1), vocab, n - 1))]

    # the long cell and its batch at ``context`` get 3x the reps: the KV term rests on
    # their difference (~5 ms of ~40), and 3 reps each put it anywhere in 0.2-1 us a token
    pair = [(long_cell[0], context, 3 * reps), (*long_cell, 3 * reps)]
    cells = [(1, context, reps), *((b, context, reps) for b in batches), *pair]
    for i, (batch, ctx, n_reps) in enumerate(cells):
        kv = model.new_kv_cache()
        slots = [kv.allocate() for _ in range(batch)]
        model.greedy_step([SeqChunk(s, prompt(ctx), 0) for s in slots], kv)
        model.greedy_step([SeqChunk(s, [100], kv.seq_len(s)) for s in slots], kv)
        for _ in range(n_reps):
            attended = sum(kv.seq_len(s) + 1 for s in slots)
            step = [SeqChunk(s, [100], kv.seq_len(s)) for s in slots]
            t0 = time.perf_counter()
            model.greedy_step(step, kv)
            if i:  # the first cell is the warm-up
                seconds = time.perf_counter() - t0
                samples.append(StepSample(0, 0.0, batch, attended, seconds, "decode"))
    for n, size in [*((n, n) for n in prompts for _ in range(reps)), *[chunked] * reps]:
        kv = model.new_kv_cache()
        slot, ids = kv.allocate(), prompt(n)
        for past in range(0, n, size):
            part = ids[past : past + size]
            t0 = time.perf_counter()
            model.greedy_step([SeqChunk(slot, part, past)], kv)
            seconds = time.perf_counter() - t0
            attn = chunk_attention(len(part), past + len(part), regimes.attention)
            samples.append(StepSample(len(part), attn, 0, 0, seconds, "prefill"))
    cost = fit_batch_cost(samples, name="measured at start", regimes=regimes)
    cost.meta["timing_spread_pct"] = repeat_floor_pct(samples)[0]
    return cost


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
        budget=None if auto_tokens else options.max_batch_tokens,
    )
    if source.startswith("measured"):
        limits = replace(limits, timing_spread_pct=cost.meta.get("timing_spread_pct"))
    options.max_num_seqs = limits.max_num_seqs
    options.max_batch_tokens = limits.max_batch_tokens
    return limits
