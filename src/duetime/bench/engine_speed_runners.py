"""The runners `duetime bench engine` times, built one at a time with their start-up figures.

Each runner (an engine variant, transformers in one dtype, llama.cpp) is built and
warmed up alone, between a reset of the process's peak RSS and a reading of it, so
its column begins with its own load time and memory (see
:mod:`duetime.bench.engine_speed` for what those figures mean). Kept apart from the
timing of the cells, which only needs the built runners and their columns.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from duetime.bench.engine_machine import peak_rss_mib, rss_mib, rss_reset, weight_bytes
from duetime.bench.engine_peers import HFRunner, LlamaCppRunner, llama_cpp_available
from duetime.bench.engine_variants import ENGINE_VARIANTS, MODEL_SWITCHES
from duetime.engine.batch import SeqChunk
from duetime.engine.config import Gemma3Config
from duetime.engine.gemma3 import Gemma3

__all__ = ["Runner", "build_runners", "prefill_s"]

Weights = dict[str, torch.Tensor]
Runner = Gemma3 | HFRunner | LlamaCppRunner
Column = dict[str, Any]  # one runner's figures: start-up, then its prefill and decode cells


def prefill_s(model: Gemma3, ids: list[int]) -> float:
    """Seconds for one prefill on a fresh KV cache: a prefill cell's time, or a warm-up."""
    kv = model.new_kv_cache()
    chunk = SeqChunk(kv.allocate(len(ids)), ids, 0)
    t = time.perf_counter()
    model.greedy_step([chunk], kv)
    return time.perf_counter() - t


def _start_up(kind: str, load_s: float, rss0: float) -> Column:
    """The figures every runner's column begins with, read right after its build and
    warm-up: what it is, its load time, and the process's peak and this runner's own
    memory (``rss0``: the resident set before the build)."""
    return {
        "kind": kind,
        "load_s": load_s,
        "peak_rss_mib": peak_rss_mib(),
        "own_rss_mib": rss_mib() - rss0,
    }


def _build_engine(
    name: str, cfg: Gemma3Config, weights: Weights, batches: Sequence[int], warm: list[int]
) -> tuple[Gemma3, Column]:
    """One engine variant, warmed up; bytes per batch, as ``q8`` reads int8 only for few rows."""
    spec = dict(ENGINE_VARIANTS[name])
    switches = {k: spec.pop(k) for k in MODEL_SWITCHES if k in spec}
    gc.collect()
    rss_reset()
    rss0 = rss_mib()
    t = time.perf_counter()
    model = Gemma3(cfg, weights, **spec)
    for switch, on in switches.items():
        setattr(model, switch, on)
    load_s = time.perf_counter() - t
    prefill_s(model, warm)
    return model, {
        **_start_up("engine", load_s, rss0),
        "weight_mb": weight_bytes(model) / 1e6,
        "weight_mb_by_batch": {b: weight_bytes(model, b) / 1e6 for b in batches},
        "kv_itemsize": model.kv_dtype.itemsize,
    }


def _build_transformers(
    dtype: str, cfg: Gemma3Config, weights: Weights, warm: list[int]
) -> tuple[HFRunner, Column]:
    """transformers on the same weights in ``dtype``, warmed up; ImportError if it is missing."""
    gc.collect()
    rss_reset()
    rss0 = rss_mib()
    t = time.perf_counter()
    hf = HFRunner(cfg, weights, torch.bfloat16 if dtype == "bf16" else torch.float32)
    load_s = time.perf_counter() - t
    hf.generate(torch.tensor([warm]), 2)
    return hf, {
        **_start_up("transformers", load_s, rss0),
        "weight_mb": hf.nbytes / 1e6,
        "kv_itemsize": 2 if dtype == "bf16" else 4,
    }


def _build_llama_cpp(gguf: Path, n_ctx: int, max_batch: int) -> tuple[LlamaCppRunner, Column]:
    """llama.cpp on the GGUF itself, sized for the longest cell and the largest batch."""
    rss_reset()
    rss0 = rss_mib()
    t = time.perf_counter()
    lc = LlamaCppRunner(gguf, torch.get_num_threads(), n_ctx=n_ctx, max_batch=max_batch)
    return lc, {
        **_start_up("llama.cpp", time.perf_counter() - t, rss0),
        "weight_mb": lc.nbytes / 1e6,
        "kv_itemsize": 2,
    }


def build_runners(
    cfg: Gemma3Config,
    weights: Weights,
    warm: list[int],
    *,
    engines: Sequence[str],
    transformers: Sequence[str],
    batches: Sequence[int],
    llama_cpp: bool,
    real: bool,
    gguf: Path | None,
    n_ctx: int,
) -> tuple[dict[str, Runner], dict[str, Column], list[str]]:
    """Runners, columns and skip notes; built one at a time so each start-up figure is its own."""
    runners: dict[str, Runner] = {}
    figs: dict[str, Column] = {}
    notes: list[str] = []
    for name in engines:
        runners[name], figs[name] = _build_engine(name, cfg, weights, batches, warm)
    for tdt in transformers:
        name = f"transformers-{tdt}"
        try:
            hf, figs_hf = _build_transformers(tdt, cfg, weights, warm)
        except ImportError as exc:  # transformers is a dependency, but keep the bench usable
            notes.append(f"{name}: skipped ({exc})")
            continue
        runners[name], figs[name] = hf, figs_hf
    if llama_cpp and real and llama_cpp_available():
        assert gguf is not None
        max_batch = max(batches, default=1)
        runners["llama.cpp"], figs["llama.cpp"] = _build_llama_cpp(gguf, n_ctx, max_batch)
    elif llama_cpp:
        why = "a tiny test model has no GGUF" if not real else "`pip install llama-cpp-python`"
        notes.append(f"llama.cpp: skipped (llama_cpp not importable or not applicable: {why})")
    for f in figs.values():
        f["prefill"], f["decode"] = [], []
    return runners, figs, notes
