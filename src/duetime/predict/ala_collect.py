"""Collect throughput curves for ALA: the real engine and simulated GPU-like configurations.

A run is ``bb`` requests of ``ii`` prompt and ``oo`` output tokens arriving
together on an executor allowed ``bb`` running sequences (FCFS); throughput
is ``bb·oo / wall`` (tok/s), as in the ALA paper. Collection is resumable:
rows are appended to a CSV one at a time and keys already present
(config, ii, oo, bb, rep) are skipped, so an interrupted run picks up where
it stopped.

Simulated configurations drive :class:`~duetime.sim.simulator.Simulator`
with a step-cost profile: the shipped A100 roofline profile and two
variants scaled from it (an H100-like and an A10G-like card). They are
roofline estimates, not measurements; a seeded log-normal jitter (2 % by
default) stands in for run-to-run variation, which the deterministic
simulator does not have.
"""

from __future__ import annotations

import dataclasses
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from duetime.predict.ala_data import Measurement, append_rows, done_keys, drop_torn_row


@dataclass(slots=True, frozen=True)
class Grid:
    """The (ii, oo, bb) shapes to run, each ``reps`` times."""

    ii: Sequence[int]
    oo: Sequence[int]
    bb: Sequence[int]
    reps: int = 1

    def shapes(self) -> list[tuple[int, int, int, int]]:
        return [
            (i, o, b, r)
            for i in self.ii
            for o in self.oo
            for b in self.bb
            for r in range(self.reps)
        ]


# 80 (ii, oo) pairs × 9 batch sizes: dense enough that held-out pairs sit between
# trained ones, as in the paper's in-house grid.
SIM_GRID = Grid(
    ii=(64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048),
    oo=(32, 64, 96, 128, 192, 256, 384, 512),
    bb=(1, 2, 4, 8, 16, 32, 64, 128, 256),
)
# ~6 minutes per configuration on the shared 2-core machine (fp32, one thread): prefill
# runs at ~150 tok/s and a decode step takes ~0.1-0.2 s, so prompts stay short.
ENGINE_GRID = Grid(ii=(16, 64, 192), oo=(8, 24, 64), bb=(1, 2, 4, 8, 16))
# 25 (ii, oo) pairs x 6 batch sizes for the 2-thread configurations: enough pairs
# that a held-out pair has trained neighbours on both sides. ~16 min with q8 on an
# idle machine (prefill ~500 tok/s, a decode step 25 ms at bb = 1 to ~0.14 s at 32).
ENGINE_GRID_T2 = Grid(ii=(16, 48, 96, 192, 384), oo=(8, 16, 32, 64, 128), bb=(1, 2, 4, 8, 16, 32))


@dataclass(slots=True, frozen=True)
class SimSpec:
    """A simulated configuration: a shipped profile, optionally rescaled.

    ``mem_scale`` multiplies the memory-bound coefficients (c0, c_prefill, d:
    weight and KV reads), ``compute_scale`` the compute-bound ones (a1, a2, b).
    """

    name: str
    profile: str = "a100-llama2-7b"
    mem_scale: float = 1.0
    compute_scale: float = 1.0
    kv_capacity: int | None = None
    noise: float = 0.02
    description: str = ""
    source: str = "sim"


@dataclass(slots=True, frozen=True)
class EngineSpec:
    """A real-engine configuration: weight dtype, torch threads, prefill chunk budget."""

    name: str
    dtype: str = "fp32"
    threads: int = 1
    max_batch_tokens: int = 2048
    description: str = ""
    source: str = "engine"
    grid: Grid = ENGINE_GRID


SIM_SPECS = (
    SimSpec(
        "sim-a100-llama2-7b",
        description="shipped A100-80GB / Llama-2-7B roofline profile (not a measurement)",
    ),
    SimSpec(
        "sim-h100like-llama2-7b",
        mem_scale=2.04 / 3.35,  # HBM3 3.35 TB/s vs 2.04 TB/s
        compute_scale=312 / 989,  # dense bf16 989 vs 312 TFLOP/s
        description="A100 profile rescaled to H100-SXM bandwidth and FLOPs (not a measurement)",
    ),
    SimSpec(
        "sim-a10glike-llama2-7b",
        mem_scale=2.04 / 0.6,  # 600 GB/s
        compute_scale=312 / 70,  # ~70 dense fp16 TFLOP/s
        kv_capacity=15_400,  # (0.9·24 GB − 13.5 GB) / 512 KiB per token
        description="A100 profile rescaled to A10G-24GB bandwidth, FLOPs and KV room "
        "(not a measurement)",
    ),
)
ENGINE_SPECS = (
    EngineSpec(
        "engine-gemma3-270m-fp32-t1", threads=1, description="real engine, fp32, 1 torch thread"
    ),
    EngineSpec(
        "engine-gemma3-270m-fp32-t2",
        threads=2,
        grid=ENGINE_GRID_T2,
        description="real engine, fp32, 2 torch threads",
    ),
    EngineSpec(
        "engine-gemma3-270m-q8-t2",
        dtype="q8",
        threads=2,
        grid=ENGINE_GRID_T2,
        description="real engine, q8 (int8 weight-only decode), 2 torch threads",
    ),
    EngineSpec(
        "engine-gemma3-270m-bf16-t2",
        dtype="bf16",
        threads=2,
        grid=ENGINE_GRID_T2,
        description="real engine, bf16 weights, activations and KV, 2 torch threads "
        "(fast only on CPUs with AVX512-BF16)",
    ),
    EngineSpec(
        "engine-gemma3-270m-bf16-t1",
        dtype="bf16",
        threads=1,
        description="real engine, bf16, 1 torch thread",
    ),
)
SPECS: dict[str, SimSpec | EngineSpec] = {s.name: s for s in (*SIM_SPECS, *ENGINE_SPECS)}


def spec(name: str) -> SimSpec | EngineSpec:
    """A collection configuration by name; unknown names list the known ones."""
    try:
        return SPECS[name]
    except KeyError:
        raise ValueError(f"unknown config {name!r}; known: {', '.join(SPECS)}") from None


def _jobs(ii: int, oo: int, bb: int, token_ids: Callable[[int], list[int]] | None) -> list[Any]:
    from duetime.core.request import Job, Request

    return [
        Job(
            Request(
                rid=k,
                arrival=0.0,
                prompt_len=ii,
                max_tokens=oo,
                prompt_token_ids=tuple(token_ids(ii)) if token_ids else None,
            ),
            output_len=oo,
        )
        for k in range(bb)
    ]


class SimRunner:
    """Runs shapes of one simulated configuration."""

    def __init__(self, s: SimSpec) -> None:
        from duetime.sim.profiles import load_profile

        cost, cfg = load_profile(s.profile)
        m, c = s.mem_scale, s.compute_scale
        self.cost = dataclasses.replace(cost.scaled(compute=c, memory=m), name=s.name)
        self.cfg = cfg
        if s.kv_capacity is not None:
            self.cfg.kv_capacity = s.kv_capacity
        self.spec = s

    def run(self, ii: int, oo: int, bb: int, rep: int) -> tuple[float, float]:
        """(throughput tok/s, simulated seconds) of one shape, with the seeded jitter."""
        from duetime.policies import make_policy
        from duetime.sim.simulator import SimConfig, Simulator

        cfg = SimConfig(
            kv_capacity=self.cfg.kv_capacity,
            max_num_seqs=bb,
            max_batch_tokens=self.cfg.max_batch_tokens,
        )
        res = Simulator(make_policy("fcfs"), self.cost, cfg).run(_jobs(ii, oo, bb, None))
        seed = zlib.crc32(repr((self.spec.name, ii, oo, bb, rep)).encode())
        wall = res.sim_time * float(np.exp(np.random.default_rng(seed).normal(0, self.spec.noise)))
        return bb * oo / wall, wall


class EngineRunner:
    """Runs shapes of one real-engine configuration (loads the model once)."""

    def __init__(self, s: EngineSpec, model: Any = None) -> None:
        import torch

        from duetime.engine import load_model

        torch.set_num_threads(s.threads)
        self.model = model if model is not None else load_model(dtype=s.dtype, progress=False)  # type: ignore[arg-type]
        self.spec = s
        vocab = self.model.config.vocab_size
        lo = min(10_000, vocab // 2)
        gen = torch.Generator().manual_seed(0)
        self.ids = lambda n: torch.randint(lo, vocab, (n,), generator=gen).tolist()
        self.run(16, 4, 2, 0)  # warm-up: first calls allocate and pick kernels

    def run(self, ii: int, oo: int, bb: int, rep: int) -> tuple[float, float]:
        """(throughput tok/s, wall seconds) of one shape on the real engine."""
        from duetime.engine.executor import EngineExecutor
        from duetime.policies import make_policy

        ex = EngineExecutor(
            make_policy("fcfs"),
            self.model,
            kv_capacity=bb * (ii + oo + 16),
            max_num_seqs=bb,
            max_batch_tokens=self.spec.max_batch_tokens,
            check_accounting=False,
        )
        t0 = time.perf_counter()
        res = ex.run(_jobs(ii, oo, bb, self.ids))
        wall = time.perf_counter() - t0
        tokens = sum(r.output_tokens for r in res.records)
        if tokens != bb * oo:
            raise RuntimeError(f"engine produced {tokens} tokens, expected {bb * oo}")
        return tokens / wall, wall


def default_grid(s: SimSpec | EngineSpec) -> Grid:
    """The grid a configuration collects unless the caller passes one."""
    return SIM_GRID if isinstance(s, SimSpec) else s.grid


def collect(
    names: Sequence[str],
    path: str | Path,
    grid: Grid | None = None,
    progress: Callable[[int, int], None] | None = None,
    runner_factory: Callable[[SimSpec | EngineSpec], Any] | None = None,
) -> dict[str, int]:
    """Run every missing shape of each configuration, appending rows to ``path``.

    Returns counts ``{"run": n, "skipped": k, "torn": t}``, ``t`` 1 where an unfinished
    last row (an interrupted append) was cut off first. ``runner_factory`` replaces the
    default runners (tests pass a stub to avoid the real model).
    """
    torn = drop_torn_row(path)
    # A name given twice is collected once: its shapes would otherwise run twice and
    # append duplicate keys (the file's keys are read once, before the first run).
    specs = [spec(n) for n in dict.fromkeys(names)]
    seen = done_keys(path)  # grows as shapes are queued: a repeated grid value runs once
    todo: list[tuple[SimSpec | EngineSpec, tuple[int, int, int, int]]] = []
    for s in specs:
        for shape in (grid or default_grid(s)).shapes():
            key = (s.name, *shape)
            if key not in seen:
                seen.add(key)
                todo.append((s, shape))
    total = len(todo)
    skipped = sum(len((grid or default_grid(s)).shapes()) for s in specs) - total
    if progress:
        progress(0, total)
    runners: dict[str, Any] = {}
    for done, (s, (ii, oo, bb, rep)) in enumerate(todo, 1):
        if s.name not in runners:
            runners.clear()  # one model in memory at a time
            if runner_factory is not None:
                runners[s.name] = runner_factory(s)
            else:
                runners[s.name] = SimRunner(s) if isinstance(s, SimSpec) else EngineRunner(s)
        thpt, wall = runners[s.name].run(ii, oo, bb, rep)
        append_rows(path, [Measurement(s.name, s.source, ii, oo, bb, rep, thpt, wall)])
        if progress:
            progress(done, total)
    return {"run": total, "skipped": skipped, "torn": int(torn is not None)}
