"""Turn a length source, an arrival process and a seed into the ``list[Job]`` every executor plays.

Deadlines, when asked for, follow one rule (:class:`Deadlines`):
``deadline = arrival + slo_scale * (ttft_s + tpot_s * L)``: ``slo_scale`` times
what a client expecting a first token within ``ttft_s`` and one token every
``tpot_s`` after it would wait. ``L`` is the job's true ``output_len`` (the
usual "SLO scale x reference latency" setup, always attainable for a fast
enough server), or its public ``max_tokens`` when a deadline must not hint at
the true length.

A shared prefix (:class:`SharedPrefix`), when asked for, puts one of a few
system prompts in front of every prompt: the workload automatic prefix caching
is for.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from duetime.core.request import MAX_TIME_S, Job, Request
from duetime.workloads.arrivals import ArrivalProcess, Poisson
from duetime.workloads.sharegpt import read_pairs
from duetime.workloads.sources import (
    LengthCaps,
    LengthSource,
    ShareGPTSource,
    SyntheticSource,
    sampling_rng,
)


@dataclass(frozen=True, slots=True)
class Deadlines:
    """``deadline = arrival + slo_scale * (ttft_s + tpot_s * L)``; see the module docstring."""

    slo_scale: float = 1.0
    ttft_s: float = 1.0
    tpot_s: float = 0.05
    basis: Literal["output_len", "max_tokens"] = "output_len"

    def __post_init__(self) -> None:
        if min(self.slo_scale, self.ttft_s, self.tpot_s) < 0 or self.slo_scale == 0:
            raise ValueError(f"deadline parameters must be >= 0 and slo_scale > 0: {self}")
        if self.basis not in ("output_len", "max_tokens"):
            raise ValueError(f"deadline basis must be output_len or max_tokens, got {self.basis!r}")

    def budget(self, output_len: int, max_tokens: int) -> float:
        """Seconds from arrival to deadline."""
        tokens = output_len if self.basis == "output_len" else max_tokens
        return self.slo_scale * (self.ttft_s + self.tpot_s * tokens)


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """Every prompt begins with one of ``groups`` prefixes of ``tokens`` tokens (a system
    prompt), drawn uniformly per request: ``<bos>``, then the prefix's own tokens, then
    the sampled prompt without its ``<bos>``. A prompt is ``tokens - 1`` tokens longer
    than sampled; the caps bound the sampled part so that the whole still fits them.
    Requests name their prefix (``Request.prefix_group``, ``prefix_len = tokens``), so a
    simulator needs no ids to know what they share."""

    tokens: int
    groups: int = 1

    def __post_init__(self) -> None:
        if self.tokens < 2:
            raise ValueError(
                f"a shared prefix needs >= 2 tokens (<bos> and one), got {self.tokens}"
            )
        if self.groups < 1:
            raise ValueError(f"a shared prefix needs >= 1 group, got {self.groups}")

    def caps_for_rest(self, caps: LengthCaps) -> LengthCaps:
        """Caps on the sampled part, so that the prompt with its prefix fits ``caps``."""
        extra = self.tokens - 1
        room = None if caps.max_total_len is None else caps.max_total_len - extra
        if room is not None and room < caps.min_prompt_len + caps.min_output_len:
            raise ValueError(
                f"the shared prefix ({self.tokens:,} tokens) leaves no room in the "
                f"{caps.max_total_len:,}-token context for a prompt and an answer"
            )

        def less(cap: int | None) -> int | None:
            return None if cap is None else cap - extra

        return replace(
            caps, max_prompt_len=less(caps.max_prompt_len), max_total_len=less(caps.max_total_len)
        )


def build_jobs(
    n: int,
    *,
    source: LengthSource | None = None,
    arrivals: ArrivalProcess | None = None,
    seed: int = 0,
    caps: LengthCaps | None = None,
    max_tokens: int = 4096,
    deadlines: Deadlines | None = None,
    with_prompt_ids: bool = False,
    with_prompt_text: bool = False,
    shared_prefix: SharedPrefix | None = None,
) -> list[Job]:
    """``n`` jobs with rids ``0..n-1`` in arrival order.

    ``source`` defaults to ShareGPT, ``arrivals`` to Poisson at 1 request/s.
    Every output fits ``max_tokens`` (it caps the sampled outputs and becomes
    each request's ``max_tokens``). ``with_prompt_ids`` fills
    ``Request.prompt_token_ids`` for the real engine; ``prompt_len`` is then
    the length of those ids. ``with_prompt_text`` fills ``Request.prompt_text``
    (ShareGPT only) for predictors that read text. ``shared_prefix`` puts a
    system prompt in front of each prompt (its text is not in ``prompt_text``). The
    same ``seed`` gives the same jobs.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    source = source if source is not None else ShareGPTSource.default()
    arrivals = arrivals if arrivals is not None else Poisson(rate=1.0)
    caps = (caps or LengthCaps()).limit_output(max_tokens)
    if shared_prefix is not None:
        caps = shared_prefix.caps_for_rest(caps)
    try:
        sample = source.sample(n, sampling_rng(seed), caps)
    except ValueError as e:  # the caps it names are what the prefix left: say so
        if shared_prefix is None:
            raise
        raise ValueError(
            f"{e} (the context less the {shared_prefix.tokens:,}-token --shared-prefix)"
        ) from None
    times = np.sort(np.asarray(arrivals.times(n, np.random.default_rng([seed, 1])), dtype=float))
    if times.shape != (n,):
        raise ValueError(f"arrival process gave {times.shape} times, expected ({n},)")
    if n and not times[-1] <= MAX_TIME_S:  # a run past it hung, or timed 0 s latencies
        raise ValueError(
            f"the arrival process puts request {n - 1} at t = {times[-1]:.3g} s, past the "
            f"{MAX_TIME_S:.0e} s a run can time: raise the arrival rate"
        )
    ids = (
        source.prompt_token_ids(sample, np.random.default_rng([seed, 2]))
        if with_prompt_ids
        else None
    )
    groups: np.ndarray | None = None
    if shared_prefix is not None:
        groups = np.random.default_rng([seed, 3]).integers(shared_prefix.groups, size=n)
        if ids is not None:
            ids = _with_prefixes(ids, groups, shared_prefix, np.random.default_rng([seed, 4]))
    texts: list[str] | None = None
    if with_prompt_text:
        if not isinstance(source, ShareGPTSource) or sample.rows is None:
            raise ValueError("prompt texts exist only for ShareGPT workloads")
        texts = [prompt for prompt, _ in read_pairs(source.lengths, sample.rows)]

    jobs = []
    for rid in range(n):
        arrival, output_len = float(times[rid]), int(sample.output_len[rid])
        deadline = None
        if deadlines is not None:
            deadline = arrival + deadlines.budget(output_len, max_tokens)
        prompt_len = len(ids[rid]) if ids is not None else int(sample.prompt_len[rid])
        group, prefix_len = None, 0
        if shared_prefix is not None and groups is not None:
            group, prefix_len = f"shared-{groups[rid]}", shared_prefix.tokens
            if ids is None:
                prompt_len += shared_prefix.tokens - 1
        request = Request(
            rid=rid,
            arrival=arrival,
            prompt_len=prompt_len,
            max_tokens=max_tokens,
            deadline=deadline,
            prompt_token_ids=ids[rid] if ids is not None else None,
            prompt_text=texts[rid] if texts is not None else None,
            prefix_group=group,
            prefix_len=prefix_len,
        )
        jobs.append(Job(request=request, output_len=output_len))
    return jobs


def _with_prefixes(
    ids: list[tuple[int, ...]], groups: np.ndarray, prefix: SharedPrefix, rng: np.random.Generator
) -> list[tuple[int, ...]]:
    """Each prompt's ids with its group's prefix in front: the prompt's own ``<bos>``
    first, then the prefix's tokens (ordinary Gemma ids, as the synthetic source draws),
    then the rest of the prompt."""
    lo, hi = SyntheticSource().vocab
    bodies = [
        tuple(rng.integers(lo, hi, size=prefix.tokens - 1).tolist()) for _ in range(prefix.groups)
    ]
    return [(p[0], *bodies[g], *p[1:]) for p, g in zip(ids, groups.tolist(), strict=True)]
