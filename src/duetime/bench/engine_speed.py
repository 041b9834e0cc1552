"""`duetime bench engine`: prefill and decode speed of the embedded engine, beside its peers.

Cells: one prompt of 128 / 512 / 2048 tokens (prefill tok/s) and one decode
step of 1 / 4 / 16 / 64 sequences after a ``context``-token prompt each
(decode tok/s = batch ÷ median step time). Engine variants (``fp32``: exact
reference; ``fast``: int8 output layer with fp32 re-scoring; ``q8``: ``fast`` plus
weight-only int8 products for steps of few rows; ``fp32-mkl``: the
previous kernels, for a before/after in one run) are measured *interleaved*,
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
every variant built before it, so ``own_rss_mb`` (RSS growth while building
and warming up that variant alone) is the figure to compare between variants.
The shared weights are paged in before any variant is built
(``shared_weights_rss_mb``), so the first one built is not charged for them.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from duetime.bench.engine_agreement import agreement, agreement_prompts
from duetime.bench.engine_machine import (
    cpu_name,
    kv_bytes_read,
    memory_bandwidth_gb_s,
    page_in,
    peak_rss_mb,
    rss_mb,
    rss_reset,
    weight_bytes,
)
from duetime.bench.engine_peers import HFRunner, LlamaCppRunner, llama_cpp_available
from duetime.bench.engine_speed_report import plot, ratios, table
from duetime.bench.engine_variants import ENGINE_VARIANTS, MODEL_SWITCHES
from duetime.engine.batch import SeqChunk
from duetime.engine.config import Gemma3Config
from duetime.engine.gemma3 import Gemma3

__all__ = ["agreement", "memory_bandwidth_gb_s", "plot", "run", "table"]

Weights = dict[str, torch.Tensor]
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


def _prefill_s(model: Gemma3, ids: list[int]) -> float:
    kv = model.new_kv_cache()
    chunk = SeqChunk(kv.allocate(len(ids)), ids, 0)
    t = time.perf_counter()
    model.greedy_step([chunk], kv)
    return time.perf_counter() - t


def _start_up(kind: str, load_s: float, rss0: float) -> dict[str, Any]:
    """The figures every runner's column begins with, read right after its build and
    warm-up: what it is, its load time, and the process's peak and this runner's own
    memory (``rss0``: the resident set before the build)."""
    return {
        "kind": kind,
        "load_s": load_s,
        "peak_rss_mb": peak_rss_mb(),
        "own_rss_mb": rss_mb() - rss0,
    }


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
    # None is "the default grid"; an empty list given on purpose (--prefill ,) is a mistake.
    for opt, given in (("--prefill", prefill_tokens), ("--batch", batch_sizes)):
        if given is not None and not len(given):
            raise ValueError(f"{opt} is empty: give at least one size, or leave it out")
    prefill = tuple(sizes[0] if prefill_tokens is None else prefill_tokens)
    batches = tuple(sizes[1] if batch_sizes is None else batch_sizes)
    ctx = context or sizes[2]
    n_steps = steps or sizes[3]
    for e in engines:
        if e not in ENGINE_VARIANTS:
            raise ValueError(f"unknown engine variant {e!r}; known: {', '.join(ENGINE_VARIANTS)}")
    for hf_dtype in transformers:
        if hf_dtype not in TRANSFORMERS_DTYPES:
            raise ValueError(
                f"unknown --transformers dtype {hf_dtype!r}; "
                f"known: {', '.join(TRANSFORMERS_DTYPES)}"
            )
    for opt, sizes_given in (("--prefill", prefill), ("--batch", batches)):
        if not all(n >= 1 for n in sizes_given):
            raise ValueError(f"{opt} sizes must be >= 1, got {','.join(map(str, sizes_given))}")
    real = source is None
    if source is None:
        from duetime.engine.gguf_file import GGUFFile
        from duetime.engine.weights import default_gguf_path

        gguf_path = Path(gguf_path) if gguf_path is not None else default_gguf_path()
        # The header alone (no weights) says how long a sequence may get.
        context = Gemma3Config.from_gguf(GGUFFile(gguf_path)).max_position_embeddings
    else:
        context = source[0].max_position_embeddings
    check_positions(prefill, ctx, n_steps, reps, context)
    if threads is not None:
        torch.set_num_threads(threads)
    if source is None:
        from duetime.engine.weights import load_weights

        assert gguf_path is not None
        cfg, weights = load_weights(gguf_path, progress=progress)
    else:
        cfg, weights = source
    notes: list[str] = []
    bandwidth = memory_bandwidth_gb_s(64 if quick else 512)
    shared_mb = page_in(weights)

    # ---- build every runner, one at a time, recording its start-up and peak RSS
    runners: dict[str, Any] = {}
    figs: dict[str, dict[str, Any]] = {}
    g = torch.Generator().manual_seed(0)
    warm = _prompt(g, 8, cfg)
    for name in engines:
        spec = dict(ENGINE_VARIANTS[name])
        switches = {k: spec.pop(k) for k in MODEL_SWITCHES if k in spec}
        gc.collect()
        rss_reset()
        rss0 = rss_mb()
        t = time.perf_counter()
        model = Gemma3(cfg, weights, **spec)
        for switch, on in switches.items():
            setattr(model, switch, on)
        load_s = time.perf_counter() - t
        _prefill_s(model, warm)
        runners[name] = model
        figs[name] = {
            **_start_up("engine", load_s, rss0),
            "weight_mb": weight_bytes(model) / 1e6,
            "weight_mb_by_batch": {b: weight_bytes(model, b) / 1e6 for b in batches},
            "kv_itemsize": model.kv_dtype.itemsize,
        }
    for tdt in transformers:
        name = f"transformers-{tdt}"
        try:
            gc.collect()
            rss_reset()
            rss0 = rss_mb()
            t = time.perf_counter()
            hf = HFRunner(cfg, weights, torch.bfloat16 if tdt == "bf16" else torch.float32)
            load_s = time.perf_counter() - t
            hf.generate(torch.tensor([warm]), 2)
        except ImportError as exc:  # transformers is a dependency, but keep the bench usable
            notes.append(f"{name}: skipped ({exc})")
            continue
        runners[name] = hf
        figs[name] = {
            **_start_up("transformers", load_s, rss0),
            "weight_mb": hf.nbytes / 1e6,
            "kv_itemsize": 2 if tdt == "bf16" else 4,
        }
    if llama_cpp and real and llama_cpp_available():
        assert gguf_path is not None
        rss_reset()
        rss0 = rss_mb()
        t = time.perf_counter()
        lc = LlamaCppRunner(
            Path(gguf_path),
            torch.get_num_threads(),
            n_ctx=max(*prefill, ctx + n_steps * reps + 8),
            max_batch=max(batches, default=1),
        )
        runners["llama.cpp"] = lc
        figs["llama.cpp"] = {
            **_start_up("llama.cpp", time.perf_counter() - t, rss0),
            "weight_mb": lc.nbytes / 1e6,
            "kv_itemsize": 2,
        }
    elif llama_cpp:
        why = "a tiny test model has no GGUF" if not real else "`pip install llama-cpp-python`"
        notes.append(f"llama.cpp: skipped (llama_cpp not importable or not applicable: {why})")
    for f in figs.values():
        f["prefill"], f["decode"] = [], []

    # ---- the cells
    cells = len(prefill) + len(batches)
    with _Progress(progress, cells) as advance:
        for n in prefill:
            ids = _prompt(g, n, cfg)
            times: dict[str, list[float]] = {k: [] for k in runners}
            for rep in range(reps):
                for name, r in runners.items():
                    if isinstance(r, Gemma3):
                        times[name].append(_prefill_s(r, ids))
                    elif rep == 0 and isinstance(r, HFRunner):
                        times[name].append(r.generate(torch.tensor([ids]), 1)[0])
                    elif isinstance(r, LlamaCppRunner):
                        times[name].append(r.prefill_s(ids))
            for name, ts in times.items():
                figs[name]["prefill"].append(
                    {"tokens": n, "prefill_tok_s": n / _median(ts), "prefill_s": _median(ts)}
                )
            advance()
        for b in batches:
            prompts = [_prompt(g, ctx, cfg) for _ in range(b)]
            engine_cells = {
                k: _EngineCell(r, prompts) for k, r in runners.items() if isinstance(r, Gemma3)
            }
            for c in engine_cells.values():
                c.steps(1)  # warm-up
            times = {k: [] for k in runners}
            for rep in range(reps):
                for name, r in runners.items():
                    if name in engine_cells:
                        times[name] += engine_cells[name].steps(n_steps)
                    elif rep == 0 and isinstance(r, HFRunner):
                        times[name] += r.generate(torch.tensor(prompts), n_steps + 2)[1][1:]
                    elif isinstance(r, LlamaCppRunner):
                        times[name] += r.decode_steps_s(prompts, n_steps)
            del engine_cells
            for name, ts in times.items():
                if not ts:
                    continue
                f = figs[name]
                step = _median(ts)
                kv_ctx = ctx + n_steps * reps // 2
                weight_mb = f.get("weight_mb_by_batch", {}).get(b, f["weight_mb"])
                nbytes = weight_mb * 1e6 + kv_bytes_read(cfg, b, kv_ctx, f["kv_itemsize"])
                roof = b * bandwidth * 1e9 / nbytes
                f["decode"].append(
                    {
                        "batch": b,
                        "decode_tok_s": b / step,
                        "step_ms": step * 1e3,
                        "step_ms_best": min(ts) * 1e3,
                        "bytes_per_step_mb": nbytes / 1e6,
                        "roofline_tok_s": roof,
                        "roofline_fraction": b / step / roof,
                    }
                )
            advance()

    # ---- fidelity of the non-exact engine variants against fp32
    agree: dict[str, Any] = {}
    ref = runners.get("fp32")
    if ref is not None:
        prompts = agreement_prompts(real, cfg, g)
        for name in engines:
            if name != "fp32" and ENGINE_VARIANTS[name]["dtype"] != "fp32":
                share, positions = agreement(ref, runners[name], prompts, 8 if quick else 32)
                agree[name] = {"top1_agreement_vs_fp32": share, "positions": positions}
    del runners
    return {
        "model": "gemma3-270m" if real else "custom",
        "gguf": str(gguf_path) if real else None,
        "machine": {
            "cpu": cpu_name(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "python": platform.python_version(),
        },
        "settings": {
            "prefill_tokens": list(prefill),
            "batch_sizes": list(batches),
            "context_tokens": ctx,
            "decode_steps_per_rep": n_steps,
            "reps": reps,
            "quick": quick,
        },
        "memory_bandwidth_gb_s": bandwidth,
        "peak_rss_mb": peak_rss_mb(),
        "shared_weights_rss_mb": shared_mb,
        "variants": figs,
        "ratios": ratios(figs),
        "agreement": agree,
        "notes": notes,
        "wall_s": time.perf_counter() - wall0,
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
