"""`duetime profile --url`: the step-cost model of any OpenAI-compatible server, black-box.

`duetime profile` times the embedded engine's steps directly; a vLLM or SGLang
server shows its steps only through the timing of its streamed tokens. So the
prober sends streamed completions (:mod:`.probe_http`) over a grid of prompt
lengths and concurrencies and reads steps off them:

* a request alone: its time to first token is about one prefill step of its
  prompt (plus the HTTP round trip, which the fit's prefill intercept takes up),
  and the gaps between its tokens are decode steps of one sequence;
* C requests sent at once: while all C are decoding (from the last one's first
  token to the first one's last) each step decodes C sequences, attending
  about C x (prompt + tokens so far) KV tokens.

Each decode window is cut into ``splits`` pieces; a piece gives one sample, its
seconds over the steps taken in it (the mean of the C streams' tokens there).
The mean step of a piece is what a linear model predicts at the piece's mean
KV, so a server that sends several tokens in one event (``duetime serve`` under
load) loses nothing but the spread of single steps.

The samples are fitted and scored exactly as `duetime profile` does
(:func:`duetime.predict.cost_report.profile_payload`), without kernel regimes: a
black box reports none. The repeats of each cell give the noise floor.
"""

from __future__ import annotations

import asyncio
import itertools
import platform
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
import numpy as np

from duetime.core.cost import chunk_attention
from duetime.predict.ete import StepSample
from duetime.server.probe_http import (
    ProbeError,
    ServerInfo,
    StreamTiming,
    discover,
    negotiate,
    probe_prompt,
    stream_completion,
)

__all__ = ["ProbeGrid", "ProbeRun", "decode_samples", "probe_server", "run_probes"]


@dataclass(slots=True, frozen=True)
class ProbeGrid:
    """What to send: each prompt length alone and at each concurrency, ``reps`` times.

    The default is 60 probes (225 requests) of at most 8 streams x 24 tokens, sized for a
    few minutes against Gemma 3 270M on 2 CPU cores (not yet timed against it); ``quick``
    is 27 probes (63 requests) of 12 tokens, a smoke test whose held-out score rests on
    about 16 samples.
    """

    prompts: tuple[int, ...] = (16, 64, 128, 256, 512)
    concurrencies: tuple[int, ...] = (2, 4, 8)
    output_tokens: int = 24
    reps: int = 3
    splits: int = 2  # samples cut from each decode window

    @classmethod
    def quick(cls) -> ProbeGrid:
        return cls(prompts=(16, 64, 128), concurrencies=(2, 4), output_tokens=12, reps=3)

    def cells(self) -> list[tuple[int, int]]:
        """``(prompt tokens, concurrency)`` in the order sent: rep by rep, so that a
        drift of the machine spreads over every cell instead of biasing some."""
        one = [(p, c) for p in self.prompts for c in (1, *self.concurrencies)]
        return one * self.reps


@dataclass(slots=True)
class ProbeRun:
    """The timed samples of a run and what it learned of the server."""

    info: ServerInfo
    samples: list[StepSample]
    noise: list[dict[str, Any]]
    tokens_per_word: float
    prompts_measured: bool  # the server reported prompt lengths (else they are estimates)
    requests: int
    skipped_windows: int  # decode windows too short to time (the server ran them apart)

    @property
    def noise_floor_pct(self) -> float | None:
        spreads = [n["spread_pct"] for n in self.noise]
        return float(np.mean(spreads)) if spreads else None


def decode_samples(
    group: list[StreamTiming], prompt_tokens: list[int], tokens: list[int], splits: int = 2
) -> list[StepSample]:
    """Decode-step samples from streams sent together (see the module docstring).

    ``tokens``: each stream's answer length. A stream's cumulative tokens are spread
    evenly over its events (one per event when the server sends one token an event).
    Empty when the streams never all decode at once or a piece holds < 2 steps.
    """
    curves = []
    for t, n in zip(group, tokens, strict=True):
        if len(t.events) < 2 or n < 2:
            return []
        ev = np.array(t.events)
        curves.append((ev, 1.0 + (n - 1) * np.arange(len(ev)) / (len(ev) - 1)))
    lo = max(float(ev[0]) for ev, _ in curves)
    hi = min(float(ev[-1]) for ev, _ in curves)
    if not hi > lo:
        return []
    out = []
    edges = np.linspace(lo, hi, max(1, splits) + 1)
    for a, b in itertools.pairwise(edges):
        took = [float(np.interp(b, ev, cum) - np.interp(a, ev, cum)) for ev, cum in curves]
        steps = float(np.mean(took))
        if steps < 2:
            continue
        mid = (a + b) / 2
        kv = sum(
            p + float(np.interp(mid, ev, cum))
            for p, (ev, cum) in zip(prompt_tokens, curves, strict=True)
        )
        out.append(StepSample(0, 0.0, len(group), round(kv), (b - a) / steps, "decode"))
    return out


def probe_server(
    url: str, model: str | None = None, timeout_s: float = 120.0
) -> tuple[ServerInfo, float, bool]:
    """Find the model, the body fields the server takes, and its tokens per prompt word.

    Returns ``(info, tokens per word, whether the server reports prompt lengths)``;
    raises :class:`ProbeError` naming ``url`` when it is unreachable or not
    OpenAI-compatible. The requests also warm the server up (untimed).
    """
    rng = np.random.default_rng(12345)
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        info = discover(client, url, model)
        info = negotiate(client, info, probe_prompt(rng, 8, 0))
    words = 64
    timing = asyncio.run(_one(info, probe_prompt(rng, words, 1), 2, timeout_s))
    if timing.prompt_tokens is None:
        return info, 1.3, False  # about what BPE tokenizers give for English words
    return info, max(0.1, (timing.prompt_tokens - 1) / (words + 1)), True


async def _one(info: ServerInfo, prompt: str, max_tokens: int, timeout_s: float) -> StreamTiming:
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as client:
        return await stream_completion(client, info, prompt, max_tokens)


def run_probes(
    info: ServerInfo,
    grid: ProbeGrid,
    tokens_per_word: float,
    prompts_measured: bool,
    *,
    progress: Callable[[int, int], None] | None = None,
    timeout_s: float = 120.0,
    seed: int = 0,
) -> ProbeRun:
    """Send the grid's probes and turn their timings into step samples."""
    room = None if info.max_model_len is None else info.max_model_len - grid.output_tokens - 8
    cells = [(p, c) for p, c in grid.cells() if room is None or p <= room]
    if not cells:
        raise ProbeError(
            f"{info.base}: no probe prompt fits the model's context of {info.max_model_len} "
            f"tokens with {grid.output_tokens} output tokens"
        )
    exact = "ignore_eos" in info.extras
    rng = np.random.default_rng(seed)
    run = ProbeRun(info, [], [], tokens_per_word, prompts_measured, 0, 0)
    per_cell: dict[tuple[str, int, int], list[float]] = {}

    async def go() -> None:
        limits = httpx.Limits(max_connections=max(c for _, c in cells) + 2)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits, trust_env=False) as client:
            for done, (p, c) in enumerate(cells):
                words = max(1, round((p - 1) / tokens_per_word) - 1)
                prompts = [probe_prompt(rng, words, run.requests + k + 2) for k in range(c)]
                group = await asyncio.gather(
                    *(stream_completion(client, info, q, grid.output_tokens) for q in prompts)
                )
                run.requests += c
                _record(run, group, p, c, grid, exact, per_cell)
                if progress is not None:
                    progress(done + 1, len(cells))

    asyncio.run(go())
    run.noise = _noise(per_cell)
    return run


def _record(
    run: ProbeRun,
    group: list[StreamTiming],
    p: int,
    c: int,
    grid: ProbeGrid,
    exact: bool,
    per_cell: dict[tuple[str, int, int], list[float]],
) -> None:
    """Add one probe's samples to ``run`` (and each cell's times, for the noise floor)."""
    lens = [t.prompt_tokens if t.prompt_tokens is not None else p for t in group]
    tokens = [t.tokens(grid.output_tokens, exact) for t in group]
    if c == 1 and group[0].ttft_s is not None:
        n = lens[0]
        ttft = group[0].ttft_s
        # a black box's kernels are unknown: its prompt attention is priced dense
        run.samples.append(StepSample(n, float(chunk_attention(n, n)), 0, 0, ttft, "prefill"))
        per_cell.setdefault(("prefill", p, 1), []).append(ttft)
    dec = decode_samples(group, lens, tokens, grid.splits)
    if not dec:
        run.skipped_windows += 1
    run.samples.extend(dec)
    if dec:
        per_cell.setdefault(("decode", p, c), []).append(float(np.mean([s.seconds for s in dec])))


def _noise(per_cell: dict[tuple[str, int, int], list[float]]) -> list[dict[str, Any]]:
    """Each repeated cell as `duetime profile`'s noise shapes: its median and its mean
    absolute deviation from it, in % of the median."""
    out = []
    for (kind, p, c), times in sorted(per_cell.items()):
        if len(times) < 2:
            continue
        med = float(np.median(times))
        spread = 100.0 * float(np.mean(np.abs(np.array(times) - med))) / med
        name = f"prefill {p}" if kind == "prefill" else f"decode b{c} prompt {p}"
        out.append({"name": name, "median_s": med, "spread_pct": spread})
    return out


def source_line(run: ProbeRun, url: str) -> str:
    """Where the numbers come from, for the profile's ``source``."""
    eos = "ignore_eos" if "ignore_eos" in run.info.extras else "no ignore_eos"
    lens = "prompt lengths reported" if run.prompts_measured else "prompt lengths estimated"
    return (
        f"measured black-box by `duetime profile --url {url}` ({run.info.model}; {eos}; "
        f"{lens}) from {platform.node()} at {datetime.now(UTC).isoformat(timespec='seconds')}: "
        f"{len(run.samples)} steps read off {run.requests} streamed requests"
    )
