"""What the benches' real-engine modes share: the model, prompt ids, and this engine's step costs.

The analytic and simulated curves a bench draws beside a real-engine curve
must be for *this* engine on *this* machine, so each engine mode either reads
a fitted profile (``--profile``, e.g. from ``duetime profile``) or times a few
steps of the shapes it is about to run and fits the simulator's linear step
cost to them (:func:`fit_cost`), the same fit ``duetime profile`` uses
(:func:`duetime.predict.ete.fit_batch_cost`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from duetime.core.cost import LinearStepCost
from duetime.core.record import RequestRecord
from duetime.core.request import Job, Request
from duetime.engine.gemma3 import DTYPES
from duetime.predict.ete import StepSample, cost_mape_pct, step_kind

# "cpu": seconds of CPU this process used. On a shared 2-core machine another
# process's burst stretches wall time by 2x or more while the engine waits for a
# core; CPU time counts only the engine's own work (memory-bandwidth contention
# still slows it). With one torch thread it stands in for an idle machine's wall
# time; we have not checked how closely.
CLOCKS: dict[str, Callable[[], float]] = {"cpu": time.process_time, "wall": time.perf_counter}


def bench_clock(name: str, threads: int) -> Callable[[], float]:
    """The clock a bench times the engine with; ``cpu`` needs one torch thread."""
    if name not in CLOCKS:
        raise ValueError(f"--clock must be cpu or wall, got {name!r}")
    if name == "cpu" and threads != 1:
        raise ValueError(
            f"--clock cpu needs --threads 1 ({threads} threads add their CPU seconds up); "
            "use --clock wall"
        )
    return CLOCKS[name]


def check_model_spec(spec: str) -> None:
    """``--model`` must be ``gemma``, ``tiny`` or an existing (GGUF) file."""
    if spec not in ("gemma", "tiny") and not Path(spec).is_file():
        raise ValueError(f"--model {spec!r}: not 'gemma', 'tiny' or an existing GGUF file")


def check_dtype(dtype: str) -> None:
    """``--dtype`` must be one the engine has."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")


def engine_context(spec: str) -> int:
    """The positions (prompt + generated tokens) the model ``--model spec`` takes.

    Read without loading its weights (the GGUF header, or the tiny model's
    config), so a run that would outgrow the model fails before the load; a bad
    name or a damaged file fails here too, naming ``--model``.
    """
    from duetime.engine.config import Gemma3Config

    check_model_spec(spec)
    if spec == "tiny":
        from duetime.engine.testing import tiny_hf_model

        return Gemma3Config.from_hf(tiny_hf_model().config).max_position_embeddings
    from duetime.engine.gguf_file import GGUFFile, ModelFileError
    from duetime.engine.weights import default_gguf_path

    try:
        gguf = GGUFFile(default_gguf_path() if spec == "gemma" else spec)
        return Gemma3Config.from_gguf(gguf).max_position_embeddings
    except ModelFileError as e:  # "<path>: <what is wrong>"
        raise ValueError(f"--model {e}") from None


def check_context(positions: int, context: int, what: str) -> None:
    """Refuse a run whose sequences need more positions than the model's context."""
    if positions > context:
        raise ValueError(
            f"{what}: {positions:,} positions, more than the model's context of {context:,}"
        )


def load_bench_model(spec: str, dtype: str = "fp32") -> Any:
    """The engine model named by ``--model``: ``gemma``, ``tiny`` or a GGUF file."""
    check_dtype(dtype)
    check_model_spec(spec)
    if spec == "tiny":
        from duetime.engine.testing import engine_from_hf, tiny_hf_model

        return engine_from_hf(tiny_hf_model(seed=0), dtype)  # type: ignore[arg-type]
    from duetime.engine.load import load_model

    if spec == "gemma":
        return load_model(dtype=dtype, progress=False)  # type: ignore[arg-type]
    return load_model(spec, dtype=dtype, progress=False)  # type: ignore[arg-type]


def burst_jobs(prompts: Sequence[Sequence[int]], new_tokens: int) -> list[Job]:
    """One job a prompt, all arriving at once, each answering ``new_tokens`` tokens
    (EOS ignored, so every run of a side-by-side bench does the same work)."""
    jobs = []
    for i, ids in enumerate(prompts):
        req = Request(
            rid=i,
            arrival=0.0,
            prompt_len=len(ids),
            prompt_token_ids=tuple(ids),
            max_tokens=new_tokens,
            ignore_eos=True,
        )
        jobs.append(Job(req, new_tokens))
    return jobs


def _id_range(vocab: int) -> tuple[int, int]:
    # Skip the special and byte tokens at the bottom of a real vocabulary.
    return min(10_000, vocab // 2), vocab


def with_synthetic_ids(jobs: Sequence[Job], vocab: int, bos: int, seed: int) -> list[Job]:
    """Copies of ``jobs`` with prompt ids: BOS, then random ordinary tokens (``prompt_len`` ids).

    Prompt content does not change a step's cost; only its length does.
    """
    rng = np.random.default_rng([seed, 11])
    lo, hi = _id_range(vocab)
    out = []
    for j in jobs:
        n = j.request.prompt_len
        ids = (bos, *rng.integers(lo, hi, n - 1).tolist()) if n else ()
        out.append(
            dataclasses.replace(j, request=dataclasses.replace(j.request, prompt_token_ids=ids))
        )
    return out


def fold_ids(jobs: Sequence[Job], vocab: int) -> list[Job]:
    """Map real tokenizer ids into a smaller test vocabulary (``id % vocab``); lengths kept."""
    out = []
    for j in jobs:
        ids = j.request.prompt_token_ids or ()
        if all(t < vocab for t in ids):
            out.append(j)
            continue
        req = dataclasses.replace(j.request, prompt_token_ids=tuple(t % vocab for t in ids))
        out.append(dataclasses.replace(j, request=req))
    return out


Shape = tuple[tuple[int, ...], int, int]  # (prompt lengths prefilled, decoders, their context)


def time_shapes(
    model: Any, shapes: Sequence[Shape], reps: int, clock: Callable[[], float]
) -> list[StepSample]:
    """Time one engine step of each shape ``reps`` times (after one untimed warm-up each).

    A shape is the prompts prefilled in the step (one chunk each: a phase of
    ``m`` prompts costs ``m`` output-layer rows, which one long prompt would
    not show) plus ``D`` sequences of the given context decoding one token.
    Like ``duetime profile``, but on the bench's ``clock`` and its shapes.
    """
    from duetime.core.cost import chunk_attention
    from duetime.engine.batch import SeqChunk
    from duetime.engine.cost_regimes import attention_shape_of_any

    shape = attention_shape_of_any(model)
    rng = np.random.default_rng(3)
    lo, hi = _id_range(model.config.vocab_size)

    def ids(n: int) -> list[int]:
        return rng.integers(lo, hi, n).tolist()

    samples = []
    for prompts, d, ctx in shapes:
        kv = model.new_kv_cache()
        slots = [kv.allocate(ctx + reps + 2) for _ in range(d)]
        group = max(1, 2048 // max(ctx, 1))
        for i in range(0, d, group):  # the decoders' context, untimed
            model.step([SeqChunk(s, ids(ctx), 0) for s in slots[i : i + group]], kv)
        for rep in range(reps + 1):
            held = sum(kv.num_tokens(s) for s in slots)
            new = [kv.allocate(p + 1) for p in prompts]
            chunks = [SeqChunk(s, ids(1), kv.seq_len(s)) for s in slots]
            chunks += [SeqChunk(s, ids(p), 0) for s, p in zip(new, prompts, strict=True)]
            t0 = clock()
            model.greedy_step(chunks, kv)
            dt = clock() - t0
            for s in new:
                kv.free(s)
            if rep:
                p_tok = sum(prompts)
                attn = sum(chunk_attention(p, p, shape) for p in prompts)
                kind = step_kind(p_tok, d)
                geometry = tuple((p, p) for p in prompts)
                samples.append(StepSample(p_tok, attn, d, held, max(dt, 1e-9), kind, geometry))
    return samples


def fit_cost(
    samples: Sequence[StepSample], name: str, model: Any = None
) -> tuple[LinearStepCost, dict[str, Any]]:
    """The simulator's step cost fitted to ``samples`` (with a band per kernel regime of
    ``model``, when given), and how well it fits them."""
    from duetime.engine.cost_regimes import regimes_of
    from duetime.predict.ete import fit_batch_cost

    regimes = regimes_of(model) if model is not None else None
    cost = fit_batch_cost(samples, name=name, regimes=regimes)
    info = {
        "source": f"fitted to {len(samples)} engine steps timed by this bench",
        "timed_steps": len(samples),
        "fit_mape_pct": cost_mape_pct(cost, samples),
        "timed_s": float(sum(s.seconds for s in samples)),
        "samples": [dataclasses.asdict(s) for s in samples],
    }
    return cost, info


def read_profile(profile: str) -> tuple[LinearStepCost, dict[str, Any]]:
    """A profile JSON or shipped name, for runs that skip the timing."""
    from duetime.sim.profiles import load_profile

    cost, _ = load_profile(profile)
    return cost, {"source": f"profile {profile}", "timed_steps": 0}


def warm_up(model: Any) -> None:
    """One untimed step: the first call allocates and picks kernels."""
    from duetime.engine.batch import SeqChunk

    kv = model.new_kv_cache()
    model.step([SeqChunk(kv.allocate(), [model.config.bos_token_id] * 8, 0)], kv)


#: The figures of :func:`latency_figures`, in the order the benches' tables list them.
LATENCY_KEYS = ("ttft_p50_s", "ttft_mean_s", "ttft_max_s", "e2e_mean_s")


def latency_figures(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Time to first token (median, mean, most) and mean end-to-end time of served requests.

    The side-by-side engine benches (`prefix-cache`, `shared-prefill`) compare these
    between a feature off and on; one definition keeps their tables meaning the same.
    """
    ttfts = [r.ttft for r in records if r.ttft is not None]
    return {
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_mean_s": statistics.fmean(ttfts),
        "ttft_max_s": max(ttfts),
        "e2e_mean_s": statistics.fmean(r.e2e for r in records if r.e2e is not None),
    }


def median_runs(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Interleaved repeats of one real-engine run as one row (`amin`, `deferred-prefill`).

    Every figure is the median over the repeats (a float), ``reps`` counts them, and
    ``kv_left_tokens`` is the most KV any repeat left allocated, since a leak in one
    repeat is a bug the median would hide.
    """
    out: dict[str, Any] = {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
    out["kv_left_tokens"] = max(r["kv_left_tokens"] for r in runs)
    out["reps"] = len(runs)
    return out
