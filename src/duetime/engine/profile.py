"""`duetime profile`: time real engine steps of chosen shapes, for the cost models.

Three families of steps, each timed ``reps`` times after a warm-up (one
untimed step per decode shape too: the first decode after set-up measured
10-30 % slower than the next ones, and the very first one of a process loads
the C++ kernels):

* one prompt of N tokens alone (TimeBill's prefill curve), and long prompts a
  chunk at a time (a chunk's attention grows with the context behind it),
* D sequences of context L decoding one token each (the decode curve; D = 1
  is TimeBill's ``p·N_kv + q``),
* D decoders plus one prefill chunk of P tokens (mixed steps, which the
  continuous-batching executor runs all the time).

The samples feed :mod:`duetime.predict.ete`. Setting sequences up (prefilling
their context) is not timed.
"""

from __future__ import annotations

import dataclasses
import random
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from duetime.core.cost import chunk_attention
from duetime.core.request import Job
from duetime.engine.batch import SeqChunk
from duetime.engine.cost_regimes import attention_shape_of
from duetime.engine.gemma3 import Gemma3
from duetime.engine.kv_cache import KVCache
from duetime.engine.step_samples import steps_from_telemetry
from duetime.predict.cost_report import fit_eviction_cost
from duetime.predict.ete import StepSample

__all__ = [
    "NoiseShape",
    "ProfileGrid",
    "fit_eviction_cost",
    "measure_evictions",
    "measure_noise",
    "measure_steps",
    "noise_drift_pct",
    "noise_floor_pct",
    "pool_noise",
    "serving_steps",
    "steps_from_telemetry",
]


@dataclass(slots=True, frozen=True)
class ProfileGrid:
    """Shapes to time. ``max_setup_tokens`` bounds D·L so set-up stays short."""

    # two prompt lengths or more between each two knots of the fit (predict.ete.ROW_KNOTS)
    prompt_lens: Sequence[int] = (
        4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 320, 384, 448, 512, 640, 768, 1024,
    )  # fmt: skip
    # every kernel regime (1-2, 3-4, 5-8, 9-11 and 12+ rows for Gemma q8 on an AMX or VNNI CPU) gets
    # two batch sizes or more, and the batch limits a server picks on 2 cores (120-135 at
    # 512 tokens) are near a measured one
    batches: Sequence[int] = (1, 2, 3, 4, 6, 8, 10, 12, 16, 24, 32, 48, 64, 96, 128)
    contexts: Sequence[int] = (32, 256, 1024)
    # (prompt, chunk): a long prompt prefilled a chunk at a time, each chunk attending
    # the ones before it (what a server does with prompts over its step budget)
    chunked: Sequence[tuple[int, int]] = ((1024, 256), (768, 192))
    mixed: Sequence[tuple[int, int, int]] = (
        (32, 1, 128), (64, 2, 128), (64, 4, 128), (256, 8, 128), (128, 16, 256), (256, 32, 64),
    )  # fmt: skip
    reps: int = 3
    max_setup_tokens: int = 8192

    @classmethod
    def quick(cls) -> ProfileGrid:
        """A small grid for tests and smoke runs."""
        return cls(
            prompt_lens=(8, 16, 32, 64),
            batches=(1, 2, 4),
            contexts=(8, 32),
            chunked=((32, 16),),
            mixed=((8, 2, 8), (16, 2, 16)),
            reps=2,
            max_setup_tokens=512,
        )


class _Timer:
    def __init__(self, model: Gemma3) -> None:
        self.model = model
        self.vocab = model.config.vocab_size
        self.gen = torch.Generator().manual_seed(0)

    def ids(self, n: int) -> list[int]:
        lo = min(10_000, self.vocab // 2)
        return torch.randint(lo, self.vocab, (n,), generator=self.gen).tolist()

    def time_step(self, chunks: list[SeqChunk], kv: KVCache) -> float:
        t0 = time.perf_counter()
        self.model.greedy_step(chunks, kv)
        return time.perf_counter() - t0

    def setup(self, kv: KVCache, batch: int, context: int) -> list[int]:
        slots = [kv.allocate(context + 64) for _ in range(batch)]
        # prefill the contexts a few sequences per step (untimed)
        group = max(1, 2048 // max(context, 1))
        for i in range(0, batch, group):
            part = slots[i : i + group]
            self.model.step([SeqChunk(s, self.ids(context), 0) for s in part], kv)
        return slots

    def decode_chunks(self, kv: KVCache, slots: list[int]) -> list[SeqChunk]:
        return [SeqChunk(s, self.ids(1), kv.seq_len(s)) for s in slots]


def measure_steps(
    model: Gemma3,
    grid: ProfileGrid | None = None,
    progress: Callable[[int, int], None] | None = None,
    seed: int = 0,
) -> list[StepSample]:
    """Time the grid's steps on ``model``; returns one sample per timed step.

    The cells (each rep of a prompt, each decode and mixed shape with its reps) run in
    a shuffled order (``seed``). Why: a shared machine's speed moves by 10 % within a
    profile's 90 s; timed family by family (prompts first, then decodes), a slow
    minute fell on one family and the fit, which shares its terms across families,
    priced the held-out prompts 15 % high. Shuffled, the drift is noise that falls
    on every family alike.
    """
    g = grid or ProfileGrid()
    t = _Timer(model)
    shape = attention_shape_of(model)
    samples: list[StepSample] = []

    def chunked(n: int, size: int) -> None:  # a whole prompt: size n
        kv = model.new_kv_cache()
        slot = kv.allocate(n)
        for past in range(0, n, size):
            ids = t.ids(min(size, n - past))
            sec = t.time_step([SeqChunk(slot, ids, past)], kv)
            geometry = ((len(ids), past + len(ids)),)
            attn = chunk_attention(len(ids), past + len(ids), shape)
            samples.append(StepSample(len(ids), attn, 0, 0, sec, "prefill", geometry))

    def decode(d: int, c: int) -> None:
        kv = model.new_kv_cache()
        slots = t.setup(kv, d, c)
        t.time_step(t.decode_chunks(kv, slots), kv)  # untimed: the first step after set-up
        for _ in range(g.reps):
            kv_tokens = sum(kv.num_tokens(s) for s in slots)
            sec = t.time_step(t.decode_chunks(kv, slots), kv)
            samples.append(StepSample(0, 0.0, d, kv_tokens, sec, "decode"))

    def mixed(p: int, d: int, c: int) -> None:
        kv = model.new_kv_cache()
        slots = t.setup(kv, d, c)
        for _ in range(g.reps):
            kv_tokens = sum(kv.num_tokens(s) for s in slots)
            new = kv.allocate(p)
            chunks = [*t.decode_chunks(kv, slots), SeqChunk(new, t.ids(p), 0)]
            sec = t.time_step(chunks, kv)
            kv.free(new)
            attn = chunk_attention(p, p, shape)
            samples.append(StepSample(p, attn, d, kv_tokens, sec, "mixed", ((p, p),)))

    cells: list[Callable[[], None]] = [
        *(partial(chunked, n, n) for n in g.prompt_lens for _ in range(g.reps)),
        *(partial(chunked, n, size) for n, size in g.chunked for _ in range(g.reps)),
        *(partial(decode, d, c) for d in g.batches for c in g.contexts
          if d * c <= g.max_setup_tokens),
        *(partial(mixed, p, d, c) for p, d, c in g.mixed),
    ]  # fmt: skip
    random.Random(seed).shuffle(cells)

    # warm-up: first calls allocate, pick kernels and load the C++ ops (a decode
    # step loads the int8 and attention kernels: seconds, once per process)
    kv = model.new_kv_cache()
    slot = kv.allocate()
    t.time_step([SeqChunk(slot, t.ids(16), 0)], kv)
    t.time_step(t.decode_chunks(kv, [slot]), kv)
    for done, cell in enumerate(cells, 1):
        cell()
        if progress:
            progress(done, len(cells))
    return samples


@dataclass(slots=True, frozen=True)
class NoiseShape:
    """One step shape repeated: its median time and its spread."""

    name: str
    median_s: float
    spread_pct: float  # mean absolute deviation from the median, % of the median
    seconds: tuple[float, ...] = ()  # every repeat, in order

    @classmethod
    def of(cls, name: str, seconds: Sequence[float]) -> NoiseShape:
        xs = sorted(seconds)
        med = xs[len(xs) // 2]
        spread = 100.0 * sum(abs(x - med) for x in xs) / len(xs) / med
        return cls(name, med, spread, tuple(seconds))


def pool_noise(*runs: Sequence[NoiseShape]) -> list[NoiseShape]:
    """The repeats of each shape from several :func:`measure_noise` runs, as one.

    Why: 15 repeats back to back show the jitter of a minute, not how the machine's
    speed moves over a run (a profile and its validation run minutes apart here
    differed by up to 10 % on the same shape). Repeating at the start and at the end
    and pooling puts that drift into the floor.
    """
    names = [s.name for s in runs[0]]
    return [
        NoiseShape.of(n, [x for run in runs for s in run if s.name == n for x in s.seconds])
        for n in names
    ]


def noise_drift_pct(first: Sequence[NoiseShape], last: Sequence[NoiseShape]) -> float:
    """Mean over the shapes of how far the median step moved from ``first`` to ``last``, %."""
    pairs = zip(first, last, strict=True)
    moved = [100.0 * abs(b.median_s - a.median_s) / a.median_s for a, b in pairs]
    return sum(moved) / len(moved)


def measure_noise(model: Gemma3, reps: int = 15) -> list[NoiseShape]:
    """The machine's noise floor: identical steps repeated ``reps`` times each.

    Why: a cost model cannot predict a step closer than the step repeats itself, and
    on shared machines that spread moves (3 % on a quiet day here, 8-15 % on a busy
    one). Shapes: one sequence decoding, 16 decoding (context 128 each), a 256-token
    prompt alone. Each decoder's context grows by a token a repeat (128 to 143: the
    KV term of a step moves well under 1 %).
    """
    t = _Timer(model)
    steps: list[tuple[str, Callable[[], float]]] = []
    for d in (1, 16):
        kv = model.new_kv_cache()
        slots = t.setup(kv, d, 128)

        def decode(kv: KVCache = kv, slots: list[int] = slots) -> float:
            return t.time_step(t.decode_chunks(kv, slots), kv)

        steps.append((f"decode b{d} ctx128", decode))

    def prefill() -> float:
        kv = model.new_kv_cache()
        return t.time_step([SeqChunk(kv.allocate(256), t.ids(256), 0)], kv)

    steps.append(("prefill 256", prefill))
    out = []
    for name, step in steps:
        step()  # warm-up
        out.append(NoiseShape.of(name, [step() for _ in range(reps)]))
    return out


def noise_floor_pct(shapes: Sequence[NoiseShape]) -> float:
    """The floor one figure gives: the mean spread of the repeated shapes."""
    return sum(s.spread_pct for s in shapes) / len(shapes)


def measure_evictions(
    model: Gemma3,
    lengths: Sequence[int] = (128, 256, 512),
    *,
    method: str = "snapkv",
    ratio: float = 0.5,
    reps: int = 2,
    window: int = 32,
) -> list[tuple[int, float]]:
    """``(KV tokens held, seconds)`` of evictions at ``ratio`` right after a prefill.

    What :attr:`LinearStepCost.e` prices: SnapKV scores every stored key against
    the prompt's last ``window`` queries and gathers the kept ones, so its cost
    grows with the KV held; StreamingLLM (``method="streaming"``) only gathers.
    One untimed eviction per length first (warm-up), then ``reps`` timed ones.
    """
    from duetime.engine.eviction import snapkv_evict, streaming_llm_evict

    if method not in ("snapkv", "streaming"):
        raise ValueError(f"method must be snapkv or streaming, got {method!r}")
    t = _Timer(model)
    out: list[tuple[int, float]] = []
    for n in lengths:
        for rep in range(reps + 1):
            kv = model.new_kv_cache()
            slot = kv.allocate(n)
            if method == "snapkv":
                kv.watch(slot, min(window, n))
            model.step([SeqChunk(slot, t.ids(n), 0)], kv)
            held = kv.num_tokens(slot)
            drop = int(ratio * held)
            t0 = time.perf_counter()
            if method == "snapkv":
                snapkv_evict(kv, slot, drop, window=min(window, n))
            else:
                streaming_llm_evict(kv, slot, drop)
            dt = time.perf_counter() - t0
            if rep:
                out.append((held, dt))
    return out


def serving_steps(
    model: Gemma3,
    *,
    requests: int = 40,
    rate: float = 2.0,
    seed: int = 1,
    max_prompt: int = 256,
    max_output: int = 64,
    kv_capacity: int = 32_768,
    max_num_seqs: int = 32,
    max_batch_tokens: int = 1024,
    jobs: Sequence[Job] | None = None,
) -> list[StepSample]:
    """The steps of a short real serving run, timed by the executor (its telemetry).

    Why: the grid's steps are clean shapes on fresh caches, while serving mixes
    one prompt chunk with a few decoders whose caches grew step by step; a fit
    on the grid alone ran real decode steps ~4 % and mixed steps ~9 % slower
    than predicted (q8, 2 threads). ShareGPT lengths, Poisson arrivals (idle
    gaps skipped), FCFS; ``seed`` defaults to 1 so that `duetime validate`'s
    default workload (seed 0) stays out of sample. Token ids are random (speed
    does not depend on them). ``jobs`` replaces the workload (tests).
    """
    from duetime.engine.executor import EngineExecutor
    from duetime.policies import make_policy
    from duetime.workloads import LengthCaps, Poisson, build_jobs

    if jobs is None:
        caps = LengthCaps(max_prompt_len=max_prompt, max_output_len=max_output)
        jobs = build_jobs(
            requests, arrivals=Poisson(rate=rate), seed=seed, caps=caps, max_tokens=max_output
        )
    t = _Timer(model)
    jobs = [
        dataclasses.replace(
            j,
            request=dataclasses.replace(
                j.request, prompt_token_ids=tuple(t.ids(j.request.prompt_len))
            ),
        )
        for j in jobs
    ]
    with tempfile.TemporaryDirectory(prefix="duetime-profile-") as where:
        path = Path(where) / "steps.jsonl"
        ex = EngineExecutor(
            make_policy("fcfs"),
            model,
            kv_capacity=kv_capacity,
            max_num_seqs=max_num_seqs,
            max_batch_tokens=max_batch_tokens,
            telemetry=path,
            skip_idle=True,
            check_accounting=False,
        )
        try:
            ex.run(jobs)
        finally:
            ex.close()
        return steps_from_telemetry(path)
