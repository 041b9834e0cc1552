"""`duetime profile`: time real engine steps of chosen shapes, for the cost models.

Three families of steps, each timed ``reps`` times after a warm-up (one
untimed step per decode shape too: the first decode after set-up measured
10-30 % slower than the next ones, and the very first one of a process loads
the C++ kernels):

* one prompt of N tokens alone (TimeBill's prefill curve),
* D sequences of context L decoding one token each (the decode curve; D = 1
  is TimeBill's ``p·N_kv + q``),
* D decoders plus one prefill chunk of P tokens (mixed steps, which the
  continuous-batching executor runs all the time).

The samples feed :mod:`duetime.predict.ete`. Setting sequences up (prefilling
their context) is not timed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from duetime.engine.batch import SeqChunk
from duetime.engine.gemma3 import Gemma3
from duetime.engine.kv_cache import KVCache
from duetime.predict.ete import StepSample


@dataclass(slots=True, frozen=True)
class ProfileGrid:
    """Shapes to time. ``max_setup_tokens`` bounds D·L so set-up stays short."""

    prompt_lens: Sequence[int] = (16, 32, 64, 128, 256, 384, 512, 768, 1024)
    batches: Sequence[int] = (1, 2, 4, 8, 16, 32)
    contexts: Sequence[int] = (32, 128, 512, 1024)
    mixed: Sequence[tuple[int, int, int]] = ((64, 4, 128), (256, 8, 128), (128, 16, 256))
    reps: int = 3
    max_setup_tokens: int = 8192

    @classmethod
    def quick(cls) -> ProfileGrid:
        """A small grid for tests and smoke runs."""
        return cls(
            prompt_lens=(8, 16, 32, 64),
            batches=(1, 2, 4),
            contexts=(8, 32),
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
        self.model.step(chunks, kv)
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
) -> list[StepSample]:
    """Time the grid's steps on ``model``; returns one sample per timed step."""
    g = grid or ProfileGrid()
    t = _Timer(model)
    decode_shapes = [(d, c) for d in g.batches for c in g.contexts if d * c <= g.max_setup_tokens]
    total = len(g.prompt_lens) + len(decode_shapes) + len(g.mixed)
    done = 0
    samples: list[StepSample] = []

    # warm-up: first calls allocate, pick kernels and load the C++ ops (a decode
    # step loads the int8 and attention kernels: seconds, once per process)
    kv = model.new_kv_cache()
    slot = kv.allocate()
    t.time_step([SeqChunk(slot, t.ids(16), 0)], kv)
    t.time_step(t.decode_chunks(kv, [slot]), kv)

    for n in g.prompt_lens:
        for _ in range(g.reps):
            kv = model.new_kv_cache()
            sec = t.time_step([SeqChunk(kv.allocate(n), t.ids(n), 0)], kv)
            samples.append(StepSample(n, float(n * n), 0, 0, sec, "prefill"))
        done += 1
        if progress:
            progress(done, total)

    for d, c in decode_shapes:
        kv = model.new_kv_cache()
        slots = t.setup(kv, d, c)
        t.time_step(t.decode_chunks(kv, slots), kv)  # untimed: the first step after set-up
        for _ in range(g.reps):
            kv_tokens = sum(kv.num_tokens(s) for s in slots)
            sec = t.time_step(t.decode_chunks(kv, slots), kv)
            samples.append(StepSample(0, 0.0, d, kv_tokens, sec, "decode"))
        done += 1
        if progress:
            progress(done, total)

    for p, d, c in g.mixed:
        kv = model.new_kv_cache()
        slots = t.setup(kv, d, c)
        for _ in range(g.reps):
            kv_tokens = sum(kv.num_tokens(s) for s in slots)
            new = kv.allocate(p)
            chunks = [*t.decode_chunks(kv, slots), SeqChunk(new, t.ids(p), 0)]
            sec = t.time_step(chunks, kv)
            kv.free(new)
            samples.append(StepSample(p, float(p * p), d, kv_tokens, sec, "mixed"))
        done += 1
        if progress:
            progress(done, total)
    return samples


def profile_payload(
    samples: Sequence[StepSample],
    *,
    name: str,
    source: str,
    kv_capacity_tokens: int,
    max_num_seqs: int,
    max_batch_tokens: int,
    holdout: float = 0.25,
    seed: int = 0,
) -> dict[str, object]:
    """Fit both models on a train split, score them on the held-out split, pack a profile.

    The coefficients written are refitted on *all* samples (the held-out
    scores say how well that procedure generalises). The result is what
    ``LinearStepCost.from_profile`` and ``duetime sim --profile`` read.
    """
    from duetime.predict.ete import evaluate, fit_batch_cost, fit_timebill, split_samples

    train, test = split_samples(samples, holdout, seed)
    heldout = evaluate(fit_batch_cost(train), fit_timebill(train), test)
    cost = fit_batch_cost(samples, name=name)
    ete = fit_timebill(samples)
    payload = cost.to_profile()
    payload.update(
        {
            "kv_capacity_tokens": kv_capacity_tokens,
            "max_num_seqs": max_num_seqs,
            "max_batch_tokens": max_batch_tokens,
            "units": "seconds per unit; t = c0 + c_prefill*[P>0] + a1*P + a2*A + b*D + d*KV",
            "source": source,
            "timebill_ete": {"a": ete.a, "b": ete.b, "c": ete.c, "p": ete.p, "q": ete.q},
            "heldout": {**heldout, "samples": len(test), "train_samples": len(train)},
            "samples": len(samples),
        }
    )
    return payload
