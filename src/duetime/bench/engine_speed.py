"""`duetime bench engine`: prefill and decode speed of the embedded engine, beside its peers.

Cells: one prompt of 128 / 512 / 2048 tokens (prefill tok/s) and one decode
step of 1 / 4 / 16 / 64 sequences after a ``context``-token prompt each
(decode tok/s = batch ÷ median step time). Engine variants (``fp32``: exact
reference; ``fast``: int8 output layer with fp32 re-scoring; ``q8``: ``fast`` plus
weight-only int8 products for steps of few rows; ``fp32-mkl``: fp32
through MKL's unpacked products and per-sequence decode attention, the
alternative the packed kernels are measured against in one run) are measured *interleaved*,
variant after variant within each repetition, so a neighbour's load hits them
alike; figures are medians. llama.cpp (when importable; batched through its C
API, see ``engine_peers.LlamaCppRunner``) is interleaved the same way;
transformers' ``generate`` (fp32 and bf16, same weights), the slowest, runs
once per cell.

Beside each decode figure: the memory roofline, i.e. the batch ÷ (bytes one
step must read — weights plus the KV it attends over — ÷ the bandwidth of a
large ``torch`` copy measured at start). Peak RSS per variant is the process's
high-water mark (``VmHWM``, reset through ``/proc/self/clear_refs``) while that
variant is built and warmed up; it includes the shared fp32 weight dict and
every variant built before it, so ``own_rss_mib`` (RSS growth while building
and warming up that variant alone) is the figure to compare between variants.
The shared weights are paged in before any variant is built
(``shared_weights_rss_mib``), so the first one built is not charged for them.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from duetime.bench.engine_agreement import agreement, agreement_prompts
from duetime.bench.engine_machine import (
    cpu_name,
    kv_bytes_read,
    memory_bandwidth_gb_s,
    page_in,
    peak_rss_mib,
)
from duetime.bench.engine_peers import HFRunner, LlamaCppRunner
from duetime.bench.engine_speed_report import plot, ratios, table
from duetime.bench.engine_speed_runners import Column, Runner, Weights, build_runners, prefill_s
from duetime.bench.engine_variants import ENGINE_VARIANTS, MODEL_SWITCHES
from duetime.engine.batch import SeqChunk
from duetime.engine.config import Gemma3Config
from duetime.engine.gemma3 import Gemma3

__all__ = ["MODEL_SWITCHES", "agreement", "memory_bandwidth_gb_s", "plot", "run", "table"]

# (prompt lengths, decode batch sizes, context tokens before decode, decode steps per rep)
FULL = ((128, 512, 2048), (1, 4, 16, 64), 128, 8)
QUICK = ((16, 64), (1, 4), 16, 3)
TRANSFORMERS_DTYPES = ("fp32", "bf16")  # the dtypes HFRunner is timed in


def _prompt(g: torch.Generator, n: int, cfg: Gemma3Config) -> list[int]:
    lo = min(3, cfg.vocab_size - 1)
    return [cfg.bos_token_id, *torch.randint(lo, cfg.vocab_size, (n - 1,), generator=g).tolist()]


class _EngineCell:
    """One variant's KV state for one decode batch."""

    def __init__(self, model: Gemma3, prompts: list[list[int]]) -> None:
        self.model = model
        self.kv = model.new_kv_cache()
        self.slots = [self.kv.allocate() for _ in prompts]
        model.step([SeqChunk(s, p, 0) for s, p in zip(self.slots, prompts, strict=True)], self.kv)

    def steps(self, n: int) -> list[float]:
        out = []
        for _ in range(n):
            chunks = [SeqChunk(s, [100], self.kv.seq_len(s)) for s in self.slots]
            t = time.perf_counter()
            self.model.greedy_step(chunks, self.kv)  # greedy, as the server decodes
            out.append(time.perf_counter() - t)
        return out


@dataclass(frozen=True)
class _Grid:
    """The checked cells and how often each runs, handed whole to the phases that need them."""

    prefill: tuple[int, ...]  # prompt lengths, one prefill cell each
    batches: tuple[int, ...]  # decode batch sizes, one decode cell each
    ctx: int  # prompt tokens of every sequence before its decode steps
    n_steps: int  # decode steps per repetition
    reps: int  # interleaved repetitions per cell

    @property
    def llama_cpp_ctx(self) -> int:
        """llama.cpp's context: room for the longest prompt and for every decode step."""
        return max(*self.prefill, self.ctx + self.n_steps * self.reps + 8)


def _median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def check_positions(
    prefill: Sequence[int], ctx: int, n_steps: int, reps: int, context: int
) -> None:
    """Every cell's sequences must fit the model's ``context`` (its positions).

    A prefill cell is one prompt of ``n`` tokens; a decode cell runs ``ctx``
    tokens, one warm-up step and ``n_steps`` per repetition. Without this,
    ``--prefill 40000`` on Gemma (32,768 positions) ended in a torch OOM.
    """
    if prefill and max(prefill) > context:
        raise ValueError(
            f"--prefill {max(prefill)}: longer than the model's context of {context:,} positions"
        )
    decode = ctx + 1 + n_steps * reps
    if decode > context:
        raise ValueError(
            f"--context {ctx} + {1 + n_steps * reps} decode steps (--reps {reps}): {decode:,} "
            f"positions, more than the model's context of {context:,}"
        )


def run(
    source: tuple[Gemma3Config, Weights] | None = None,
    *,
    quick: bool = False,
    engines: Sequence[str] = ("fp32", "fast", "q8", "fp32-mkl"),
    prefill_tokens: Sequence[int] | None = None,
    batch_sizes: Sequence[int] | None = None,
    context: int | None = None,
    steps: int | None = None,
    reps: int = 3,
    transformers: Sequence[str] = ("fp32", "bf16"),
    llama_cpp: bool = True,
    threads: int | None = None,
    gguf_path: str | Path | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    """Time every variant on every cell; returns the figures (JSON-ready).

    ``source``: (config, weights) to use instead of the packaged Gemma 3 270M
    (tests pass a tiny random model). ``quick`` shrinks sizes (and the bandwidth
    probe) so the whole run takes seconds on a tiny model.
    """
    wall0 = time.perf_counter()
    sizes = QUICK if quick else FULL
    grid = _checked_grid(
        sizes, engines, transformers, prefill_tokens, batch_sizes, context, steps, reps
    )
    real = source is None
    gguf, positions = _gguf_and_positions(source, gguf_path)
    check_positions(grid.prefill, grid.ctx, grid.n_steps, grid.reps, positions)
    if threads is not None:
        torch.set_num_threads(threads)
    cfg, weights = _load(source, gguf, progress)
    bandwidth = memory_bandwidth_gb_s(64 if quick else 512)
    shared_mib = page_in(weights)
    g = torch.Generator().manual_seed(0)
    runners, figs, notes = build_runners(
        cfg,
        weights,
        _prompt(g, 8, cfg),
        engines=engines,
        transformers=transformers,
        batches=grid.batches,
        llama_cpp=llama_cpp,
        real=real,
        gguf=gguf,
        n_ctx=grid.llama_cpp_ctx,
    )
    with _Progress(progress, len(grid.prefill) + len(grid.batches)) as advance:
        for n in grid.prefill:
            _time_prefill(runners, figs, _prompt(g, n, cfg), grid.reps)
            advance()
        for b in grid.batches:
            prompts = [_prompt(g, grid.ctx, cfg) for _ in range(b)]
            _time_decode(runners, figs, prompts, grid, cfg, bandwidth)
            advance()
    agree = _agreement(runners, engines, real, cfg, g, 8 if quick else 32)
    del runners
    return {
        "model": "gemma3-270m" if real else "custom",
        "gguf": str(gguf) if real else None,
        "machine": _machine(),
        "settings": {
            "prefill_tokens": list(grid.prefill),
            "batch_sizes": list(grid.batches),
            "context_tokens": grid.ctx,
            "decode_steps_per_rep": grid.n_steps,
            "reps": grid.reps,
            "quick": quick,
        },
        "memory_bandwidth_gb_s": bandwidth,
        "peak_rss_mib": peak_rss_mib(),
        "shared_weights_rss_mib": shared_mib,
        "variants": figs,
        "ratios": ratios(figs),
        "agreement": agree,
        "notes": notes,
        "wall_s": time.perf_counter() - wall0,
    }


def _checked_grid(
    sizes: tuple[tuple[int, ...], tuple[int, ...], int, int],
    engines: Sequence[str],
    transformers: Sequence[str],
    prefill_tokens: Sequence[int] | None,
    batch_sizes: Sequence[int] | None,
    context: int | None,
    steps: int | None,
    reps: int,
) -> _Grid:
    """The cells from the options, refusing bad ones before anything loads so none costs a load."""
    # None is "the default grid"; an empty list given on purpose (--prefill ,) is a mistake.
    for opt, given in (("--prefill", prefill_tokens), ("--batch", batch_sizes)):
        if given is not None and not len(given):
            raise ValueError(f"{opt} is empty: give at least one size, or leave it out")
    grid = _Grid(
        prefill=tuple(sizes[0] if prefill_tokens is None else prefill_tokens),
        batches=tuple(sizes[1] if batch_sizes is None else batch_sizes),
        ctx=context or sizes[2],
        n_steps=steps or sizes[3],
        reps=reps,
    )
    for e in engines:
        if e not in ENGINE_VARIANTS:
            raise ValueError(f"unknown engine variant {e!r}; known: {', '.join(ENGINE_VARIANTS)}")
    for hf_dtype in transformers:
        if hf_dtype not in TRANSFORMERS_DTYPES:
            raise ValueError(
                f"unknown --transformers dtype {hf_dtype!r}; "
                f"known: {', '.join(TRANSFORMERS_DTYPES)}"
            )
    for opt, sizes_given in (("--prefill", grid.prefill), ("--batch", grid.batches)):
        if not all(n >= 1 for n in sizes_given):
            raise ValueError(f"{opt} sizes must be >= 1, got {','.join(map(str, sizes_given))}")
    return grid


def _gguf_and_positions(
    source: tuple[Gemma3Config, Weights] | None, gguf_path: str | Path | None
) -> tuple[Path | None, int]:
    """The GGUF (None for ``source``) and its positions, from the header so checks precede loads."""
    if source is not None:
        return None, source[0].max_position_embeddings
    from duetime.engine.gguf_file import GGUFFile
    from duetime.engine.weights import default_gguf_path

    gguf = Path(gguf_path) if gguf_path is not None else default_gguf_path()
    return gguf, Gemma3Config.from_gguf(GGUFFile(gguf)).max_position_embeddings


def _load(
    source: tuple[Gemma3Config, Weights] | None, gguf: Path | None, progress: bool
) -> tuple[Gemma3Config, Weights]:
    """The config and fp32 weights every runner shares: ``source``, or the GGUF's."""
    if source is not None:
        return source
    from duetime.engine.weights import load_weights

    assert gguf is not None
    return load_weights(gguf, progress=progress)


def _time_prefill(
    runners: dict[str, Runner], figs: dict[str, Column], ids: list[int], reps: int
) -> None:
    """One prefill cell, reps interleaved across runners so a neighbour's load hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in runners}
    for rep in range(reps):
        for name, r in runners.items():
            if isinstance(r, Gemma3):
                times[name].append(prefill_s(r, ids))
            elif rep == 0 and isinstance(r, HFRunner):
                times[name].append(r.generate(torch.tensor([ids]), 1)[0])
            elif isinstance(r, LlamaCppRunner):
                times[name].append(r.prefill_s(ids))
    n = len(ids)
    for name, ts in times.items():
        figs[name]["prefill"].append(
            {"tokens": n, "prefill_tok_s": n / _median(ts), "prefill_s": _median(ts)}
        )


def _time_decode(
    runners: dict[str, Runner],
    figs: dict[str, Column],
    prompts: list[list[int]],
    grid: _Grid,
    cfg: Gemma3Config,
    bandwidth: float,
) -> None:
    """One decode cell, interleaved like a prefill cell, so a neighbour's load hits all alike."""
    engine_cells = {k: _EngineCell(r, prompts) for k, r in runners.items() if isinstance(r, Gemma3)}
    for c in engine_cells.values():
        c.steps(1)  # warm-up
    times: dict[str, list[float]] = {k: [] for k in runners}
    for rep in range(grid.reps):
        for name, r in runners.items():
            if name in engine_cells:
                times[name] += engine_cells[name].steps(grid.n_steps)
            elif rep == 0 and isinstance(r, HFRunner):
                times[name] += r.generate(torch.tensor(prompts), grid.n_steps + 2)[1][1:]
            elif isinstance(r, LlamaCppRunner):
                times[name] += r.decode_steps_s(prompts, grid.n_steps)
    del engine_cells
    for name, ts in times.items():
        if ts:
            figs[name]["decode"].append(
                _decode_cell(figs[name], ts, len(prompts), grid, cfg, bandwidth)
            )


def _decode_cell(
    f: Column, ts: list[float], b: int, grid: _Grid, cfg: Gemma3Config, bandwidth: float
) -> dict[str, Any]:
    """A runner's decode figures for batch ``b``, beside the memory roofline that bounds them."""
    step = _median(ts)
    kv_ctx = grid.ctx + grid.n_steps * grid.reps // 2
    weight_mb = f.get("weight_mb_by_batch", {}).get(b, f["weight_mb"])
    nbytes = weight_mb * 1e6 + kv_bytes_read(cfg, b, kv_ctx, f["kv_itemsize"])
    roof = b * bandwidth * 1e9 / nbytes
    return {
        "batch": b,
        "decode_tok_s": b / step,
        "step_ms": step * 1e3,
        "step_ms_best": min(ts) * 1e3,
        "bytes_per_step_mb": nbytes / 1e6,
        "roofline_tok_s": roof,
        "roofline_fraction": b / step / roof,
    }


def _agreement(
    runners: dict[str, Runner],
    engines: Sequence[str],
    real: bool,
    cfg: Gemma3Config,
    g: torch.Generator,
    n: int,
) -> dict[str, Any]:
    """Top-1 agreement of each non-fp32 engine variant with fp32: the fidelity its speed costs."""
    models = {k: r for k, r in runners.items() if isinstance(r, Gemma3)}
    agree: dict[str, Any] = {}
    ref = models.get("fp32")
    if ref is not None:
        prompts = agreement_prompts(real, cfg, g)
        for name in engines:
            if name != "fp32" and ENGINE_VARIANTS[name]["dtype"] != "fp32":
                share, positions = agreement(ref, models[name], prompts, n)
                agree[name] = {"top1_agreement_vs_fp32": share, "positions": positions}
    return agree


def _machine() -> dict[str, Any]:
    """What the figures were measured on, to tell runs on different machines apart."""
    return {
        "cpu": cpu_name(),
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "python": platform.python_version(),
    }


class _Progress:
    """A rich progress bar over the cells (or nothing)."""

    def __init__(self, enabled: bool, total: int) -> None:
        self.enabled, self.total = enabled, total

    def __enter__(self) -> Callable[[], None]:
        if not self.enabled:
            return lambda: None
        from rich.progress import Progress

        self._bar = Progress(transient=True)
        self._bar.start()
        task = self._bar.add_task("bench engine", total=self.total)
        return lambda: self._bar.advance(task)

    def __exit__(self, *exc: object) -> None:
        if self.enabled:
            self._bar.stop()
