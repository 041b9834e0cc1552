"""Where (prompt_len, output_len) pairs come from: ShareGPT, or fixed/uniform synthetic lengths.

A :class:`LengthSource` samples ``n`` pairs that fit some :class:`LengthCaps`
and, for the real engine, can supply prompt token ids for them. Sampling uses
only the generator it is given; :func:`sampling_rng` is the one the builder
uses, so ``build_jobs(n, seed=s)`` and ``load_sharegpt_prompts(n, seed=s)``
(same caps) pick the same conversations in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from duetime.tokenizer import load_gemma_tokenizer
from duetime.workloads.sharegpt import ShareGPTLengths, load_sharegpt_lengths, read_pairs


def sampling_rng(seed: int) -> np.random.Generator:
    """The generator lengths are drawn from for ``seed`` (stream 0; arrivals use stream 1)."""
    return np.random.default_rng([seed, 0])


@dataclass(frozen=True, slots=True)
class LengthCaps:
    """Bounds a pair must satisfy. ShareGPT pairs outside are *dropped* (not clipped), so the
    distribution has no spike at a cap; synthetic ranges are clipped to them instead.
    """

    max_prompt_len: int | None = None
    max_output_len: int | None = None
    max_total_len: int | None = None  # prompt + output: the context a request needs
    min_prompt_len: int = 1
    min_output_len: int = 1

    @classmethod
    def vllm(cls) -> LengthCaps:
        """vLLM's ShareGPT filter: both >= 4 tokens, prompt <= 1024, prompt + output <= 2048."""
        return cls(max_prompt_len=1024, max_total_len=2048, min_prompt_len=4, min_output_len=4)

    def limit_output(self, max_tokens: int) -> LengthCaps:
        """These caps, with outputs no longer than ``max_tokens``."""
        cap = max_tokens if self.max_output_len is None else min(self.max_output_len, max_tokens)
        return replace(self, max_output_len=cap)

    def describe(self) -> str:
        """The bounds in words, for messages (the repr named fields no option has)."""
        prompt = _span(self.min_prompt_len, self.max_prompt_len)
        output = _span(self.min_output_len, self.max_output_len)
        total = "" if self.max_total_len is None else f", prompt + output <= {self.max_total_len}"
        return f"prompts of {prompt} tokens, outputs of {output} tokens{total}"

    def mask(self, prompt_len: np.ndarray, output_len: np.ndarray) -> np.ndarray:
        """Boolean mask of the pairs within bounds."""
        big = np.iinfo(np.int64).max
        return (
            (prompt_len >= self.min_prompt_len)
            & (output_len >= self.min_output_len)
            & (prompt_len <= (self.max_prompt_len or big))
            & (output_len <= (self.max_output_len or big))
            & (prompt_len + output_len <= (self.max_total_len or big))
        )


@dataclass(frozen=True, slots=True)
class LengthSample:
    """``n`` sampled pairs; ``rows`` are the ShareGPT rows they came from (None if synthetic)."""

    prompt_len: np.ndarray
    output_len: np.ndarray
    rows: np.ndarray | None = None


class LengthSource(Protocol):
    def sample(self, n: int, rng: np.random.Generator, caps: LengthCaps) -> LengthSample:
        """``n`` pairs within ``caps``; raises ValueError if none can fit."""
        ...

    def prompt_token_ids(
        self, sample: LengthSample, rng: np.random.Generator
    ) -> list[tuple[int, ...]]:
        """Token ids (``<bos>`` first) for each sampled prompt, for the real engine."""
        ...


@dataclass(frozen=True, slots=True)
class ShareGPTSource:
    """Samples ShareGPT rows: without replacement when ``n`` fits in the pool, else with.

    ``pool`` restricts the rows that may be drawn (e.g. a predictor's held-out
    split); None allows every row.
    """

    lengths: ShareGPTLengths
    pool: np.ndarray | None = None

    @classmethod
    def default(cls) -> ShareGPTSource:
        return cls(load_sharegpt_lengths())

    def sample(self, n: int, rng: np.random.Generator, caps: LengthCaps) -> LengthSample:
        pool = np.flatnonzero(caps.mask(self.lengths.prompt_len, self.lengths.output_len))
        if self.pool is not None:
            pool = np.intersect1d(pool, self.pool)
        if pool.size == 0:
            raise ValueError(f"no ShareGPT pair fits {caps.describe()}")
        rows = rng.choice(pool, size=n, replace=n > pool.size)
        return LengthSample(self.lengths.prompt_len[rows], self.lengths.output_len[rows], rows)

    def prompt_token_ids(
        self, sample: LengthSample, rng: np.random.Generator
    ) -> list[tuple[int, ...]]:
        assert sample.rows is not None, "not a ShareGPT sample"
        texts = [prompt for prompt, _ in read_pairs(self.lengths, sample.rows)]
        encodings = load_gemma_tokenizer().encode_batch(texts, add_special_tokens=True)
        return [tuple(e.ids) for e in encodings]


@dataclass(frozen=True, slots=True)
class SyntheticSource:
    """Fixed lengths (an int) or uniform ones (inclusive ``(lo, hi)``); needs no dataset.

    Caps clip the ranges; the output is then cut so prompt + output fits
    ``max_total_len``. Prompt ids are ``<bos>`` and uniform ids from ``vocab``, a
    range of ordinary Gemma tokens, so the engine does real work on them.
    """

    prompt_len: int | tuple[int, int] = 128
    output_len: int | tuple[int, int] = 128
    bos_id: int = 2
    vocab: tuple[int, int] = (10_000, 200_000)

    def sample(self, n: int, rng: np.random.Generator, caps: LengthCaps) -> LengthSample:
        prompt = _uniform(
            "prompt", self.prompt_len, caps.min_prompt_len, caps.max_prompt_len, n, rng
        )
        output = _uniform(
            "output", self.output_len, caps.min_output_len, caps.max_output_len, n, rng
        )
        if caps.max_total_len is not None:
            output = np.minimum(output, caps.max_total_len - prompt)
            if n and output.min() < caps.min_output_len:
                raise ValueError(
                    f"prompts of {prompt.max()} tokens leave no room for an output of "
                    f"{caps.min_output_len} under prompt + output <= {caps.max_total_len} tokens"
                )
        return LengthSample(prompt, output)

    def prompt_token_ids(
        self, sample: LengthSample, rng: np.random.Generator
    ) -> list[tuple[int, ...]]:
        lo, hi = self.vocab
        return [
            (self.bos_id, *rng.integers(lo, hi, size=int(p) - 1).tolist())
            for p in sample.prompt_len
        ]


def _uniform(
    what: str,
    spec: int | tuple[int, int],
    floor: int,
    cap: int | None,
    n: int,
    rng: np.random.Generator,
) -> np.ndarray:
    lo, hi = (spec, spec) if isinstance(spec, int) else spec
    asked = f"{lo}..{hi}"
    lo = max(lo, floor)
    hi = hi if cap is None else min(hi, cap)
    if lo > hi:
        raise ValueError(f"{what} lengths {asked} do not fit {what}s of {_span(floor, cap)} tokens")
    return rng.integers(lo, hi, size=n, endpoint=True, dtype=np.int64)


@dataclass(frozen=True, slots=True)
class ShareGPTPrompt:
    """One sampled conversation's texts and lengths (``prompt_len`` includes ``<bos>``)."""

    conv_id: str
    prompt: str
    output: str
    prompt_len: int
    output_len: int


def load_sharegpt_prompts(
    n: int, seed: int = 0, *, caps: LengthCaps | None = None, max_tokens: int = 4096
) -> list[ShareGPTPrompt]:
    """``n`` sampled ShareGPT pairs with their texts: the same ones ``build_jobs`` picks for
    the same ``n``, ``seed``, ``caps`` and ``max_tokens``.
    """
    source = ShareGPTSource.default()
    caps = (caps or LengthCaps()).limit_output(max_tokens)
    sample = source.sample(n, sampling_rng(seed), caps)
    assert sample.rows is not None
    texts = read_pairs(source.lengths, sample.rows)
    return [
        ShareGPTPrompt(
            conv_id=str(source.lengths.conv_id[row]),
            prompt=prompt,
            output=output,
            prompt_len=int(source.lengths.prompt_len[row]),
            output_len=int(source.lengths.output_len[row]),
        )
        for row, (prompt, output) in zip(sample.rows, texts, strict=True)
    ]


def _span(lo: int, hi: int | None) -> str:
    return f">= {lo}" if hi is None else f"{lo}..{hi}"
