"""`duetime bench serve-load`: a loaded `duetime serve` beside its own engine, offline.

For each arrival rate, the real server (in this process, its HTTP on one thread
and the engine on another, as `duetime serve` runs) takes `duetime load`'s
open-loop load from a separate process, as a user's client would send it. The
engine thread logs every round (:mod:`duetime.server.step_log`): its forward
pass, scheduling, token delivery, stats refresh, inbox and idle time. Then the
same requests (the same token ids, at the same arrival times) go through the
same executor offline, on the main thread with no HTTP, and its steps are
logged too (the executor's telemetry).

What it answers: how much of the engine's speed the server keeps. Per running
batch size, the served forward pass is set beside the offline one at the same
batch (same prompts, same answers so far, so the same KV lengths), and the
served output tokens/s beside the offline run's over the same requests. CPU
seconds per thread say who else used the two cores: the HTTP thread, the
client, the engine's compute threads.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from duetime.bench.serve_load_steps import served_summary, steps_by_band
from duetime.core.request import Job, Request
from duetime.engine.gemma3 import Gemma3
from duetime.engine.openmp_workers import own_workers, release_workers
from duetime.server.app import create_app
from duetime.server.autosize import DEFAULT_TPOT_TARGET_MS, size_options
from duetime.server.build import (
    ServeOptions,
    build_state,
    load_served_model,
    served_context,
    served_executor,
)
from duetime.server.codec import Codec
from duetime.server.load_workload import LoadRequest, LoadWorkload
from duetime.server.step_log import StepLog
from duetime.server.threaded import serve_in_thread

__all__ = ["ServeLoadConfig", "run_serve_load"]


@dataclass(slots=True)
class ServeLoadConfig:
    """One `bench serve-load` run: the server as `duetime serve` would run it, then
    `duetime load`'s synthetic load at each of ``rates``."""

    model: str = "gemma"
    dtype: str = "q8"
    threads: int = 2
    policy: str = "edf"
    rates: Sequence[float] = (1.0, 4.0, math.inf)
    #: Requests per rate (one number for all, or one per rate).
    requests: Sequence[int] = (60, 80, 100)
    prompt_len: int = 256
    output_len: int = 128
    max_num_seqs: int | None = None  # None: auto, as `duetime serve` sizes it
    max_batch_tokens: int | None = None
    tpot_target_ms: float = DEFAULT_TPOT_TARGET_MS  # what auto sizes for, as `duetime serve`
    sizing_context: int = 512
    kv_capacity: int = 32_768
    offline: bool = True  # replay each rate's requests offline too
    seed: int = 0
    client_timeout_s: float = 1800.0

    def requests_at(self, i: int) -> int:
        reqs = list(self.requests)
        return reqs[0] if len(reqs) == 1 else reqs[i]

    def check(self) -> None:
        if not self.rates:
            raise ValueError("--rates is empty: give at least one rate, e.g. 1,4,inf")
        if any(not r > 0 for r in self.rates):
            raise ValueError(f"--rates must be > 0 (inf: all at once), got {list(self.rates)}")
        if len(self.requests) not in (1, len(self.rates)):
            raise ValueError(
                f"--requests gives {len(self.requests)} numbers for {len(self.rates)} rates: "
                "give one, or one per rate"
            )
        if any(n < 1 for n in self.requests):
            raise ValueError(f"--requests must be >= 1, got {list(self.requests)}")
        if self.prompt_len < 1 or self.output_len < 1:
            raise ValueError("--prompt-len and --output-len must be >= 1")
        context = served_context(self.kv_capacity)  # before the model loads: KV bounds it
        if self.prompt_len + self.output_len > context:
            raise ValueError(
                f"--prompt-len {self.prompt_len} + --output-len {self.output_len} exceeds "
                f"the served context of {context} tokens: every request would be refused"
            )


def _options(cfg: ServeLoadConfig) -> ServeOptions:
    opts = ServeOptions(
        model=cfg.model,
        policy=cfg.policy,
        dtype=cfg.dtype,
        kv_capacity=cfg.kv_capacity,
        predictor=None,  # every request is ignore-EOS: its length is known exactly
        seed=cfg.seed,
    )
    if cfg.max_num_seqs is not None:
        opts.max_num_seqs = cfg.max_num_seqs
    if cfg.max_batch_tokens is not None:
        opts.max_batch_tokens = cfg.max_batch_tokens
    return opts


def _thread_cpu_s() -> dict[str, float]:
    """CPU seconds of each of this process's threads, by Python thread name where it
    has one (the engine's compute threads are native: "native")."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:
            continue  # the thread ended meanwhile
        fields = stat[stat.rindex(")") + 2 :].split()
        name = names.get(int(tid), "native")
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _client(
    cfg: ServeLoadConfig, url: str, rate: float, n: int, out: Path
) -> tuple[dict[str, Any], float]:
    """`duetime load` in its own process; its summary row and its CPU seconds."""
    args = [
        *("load", "--url", url, "--workload", "synthetic"),
        *("--prompt-len", str(cfg.prompt_len), "--output-len", str(cfg.output_len)),
        *("--max-tokens", str(cfg.output_len), "--max-context", str(cfg.kv_capacity)),
        *("--ignore-eos", "--rate", "inf" if math.isinf(rate) else f"{rate:g}"),
        *("--requests", str(n), "--seed", str(cfg.seed), "--duration", "3600"),
        *("--drain-timeout", str(cfg.client_timeout_s)),
        *("--request-timeout", str(cfg.client_timeout_s), "--json", str(out)),
    ]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run(
        [sys.executable, "-c", "from duetime.cli import app; app()", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        timeout=cfg.client_timeout_s * 2 + 600,
    )
    if done.returncode != 0:  # its own one-line error, not a traceback of this process
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise ValueError(f"the load client (duetime load) failed, exit {done.returncode}: {last}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return json.loads(out.read_text())["rows"][0], cpu


def _served(
    cfg: ServeLoadConfig,
    opts: ServeOptions,
    served: tuple[Gemma3, Codec, str],
    rate: float,
    n: int,
    tmp: Path,
) -> dict[str, Any]:
    state = build_state(opts, *served)
    log = StepLog()
    state.engine.step_log = log
    # as in `duetime serve`, whose engine loop starts on the thread that loaded the model:
    # that thread (here the main one) gives its OpenMP workers back
    release_workers()
    with serve_in_thread(create_app(state)) as url:
        cpu0 = _thread_cpu_s()
        t0 = time.perf_counter()
        row, client_cpu = _client(cfg, url, rate, n, tmp / "load.json")
        wall = time.perf_counter() - t0
        cpu1 = _thread_cpu_s()
    own_workers(cfg.threads)  # the offline replay runs here
    cpu = {k: round(v - cpu0.get(k, 0.0), 2) for k, v in cpu1.items() if v - cpu0.get(k, 0.0)}
    cpu["client"] = round(client_cpu, 2)
    rows = log.rows()
    return {
        "client": {k: v for k, v in row.items() if k not in ("classes", "top_errors")},
        "errors": row.get("top_errors", {}),
        "wall_s": wall,
        "cpu_s": cpu,
        "steps": served_summary(rows),
        "_rows": rows,
    }


def _jobs(codec: Codec, plan: Sequence[LoadRequest]) -> list[Job]:
    """The load's requests as the server makes them: its prompts' ids, ignore-EOS."""
    jobs = []
    for i, lr in enumerate(plan):
        ids = tuple(codec.encode(lr.prompt))
        req = Request(
            rid=i + 1,
            arrival=lr.arrival,
            prompt_len=len(ids),
            max_tokens=lr.max_tokens,
            prompt_token_ids=ids,
            ignore_eos=True,
        )
        jobs.append(Job(req, output_len=lr.max_tokens))
    return jobs


def _offline(
    opts: ServeOptions,
    model: Gemma3,
    codec: Codec,
    plan: Sequence[LoadRequest],
    tmp: Path,
) -> dict[str, Any]:
    """The same requests at the same arrival times through the same executor, with no
    server: its steps (telemetry) and its output tokens/s."""
    telemetry = tmp / "offline-steps.jsonl"
    ex = served_executor(opts, model, codec, telemetry=telemetry)
    jobs = _jobs(codec, plan)
    result = ex.run(jobs)
    steps = [json.loads(line) for line in telemetry.read_text().splitlines() if line]
    records = [r for r in result.records if r.finish is not None]
    first = min(j.request.arrival for j in jobs)
    span = max(r.finish for r in records if r.finish is not None) - first
    tokens = sum(r.output_tokens for r in records)
    return {
        "wall_s": span,
        "output_tok_s": tokens / span if span > 0 else None,
        "steps": len(steps),
        "_steps": steps,
    }


def run_serve_load(
    cfg: ServeLoadConfig, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    """Every rate served (and replayed offline): the figures `bench serve-load` prints."""
    from duetime.engine.malloc_tuning import keep_large_blocks

    cfg.check()
    keep_large_blocks()  # as `duetime serve` does, before any thread allocates
    torch.set_num_threads(cfg.threads)
    opts = _options(cfg)  # sized once below, then every rate's server and replay use it
    model, codec, name = load_served_model(opts)
    limits = size_options(
        opts,
        model,
        auto_seqs=cfg.max_num_seqs is None,
        auto_tokens=cfg.max_batch_tokens is None,
        tpot_target_s=cfg.tpot_target_ms / 1000,
        context=cfg.sizing_context,
    )
    cfg = replace(cfg, max_num_seqs=opts.max_num_seqs, max_batch_tokens=opts.max_batch_tokens)
    total = len(cfg.rates) * (2 if cfg.offline else 1)
    done = 0
    runs = []
    for i, rate in enumerate(cfg.rates):
        n = cfg.requests_at(i)
        with tempfile.TemporaryDirectory(prefix="duetime-serve-load-") as d:
            tmp = Path(d)
            served = _served(cfg, opts, (model, codec, name), rate, n, tmp)
            done += 1
            if progress:
                progress(done, total)
            plan = _plan(cfg, rate, n)
            offline = _offline(opts, model, codec, plan, tmp) if cfg.offline else None
            if offline is not None:
                done += 1
                if progress:
                    progress(done, total)
        runs.append(_run_row(rate, n, served, offline))
    return {
        "model": name,
        "dtype": cfg.dtype,
        "threads": cfg.threads,
        "policy": cfg.policy,
        "max_num_seqs": cfg.max_num_seqs,
        "max_batch_tokens": cfg.max_batch_tokens,
        "limits": limits.as_dict(),
        "prompt_len": cfg.prompt_len,
        "output_len": cfg.output_len,
        "runs": runs,
    }


def _plan(cfg: ServeLoadConfig, rate: float, n: int) -> list[LoadRequest]:
    """The requests `duetime load` sent (it builds them from the same seed)."""
    workload = LoadWorkload(
        workload="synthetic",
        requests=n,
        seed=cfg.seed,
        prompt_len=(cfg.prompt_len, cfg.prompt_len),
        output_len=(cfg.output_len, cfg.output_len),
        max_tokens=cfg.output_len,
        max_context=cfg.kv_capacity,
    )
    return workload.build(rate)


def _run_row(
    rate: float, n: int, served: dict[str, Any], offline: dict[str, Any] | None
) -> dict[str, Any]:
    client = served["client"]
    row: dict[str, Any] = {
        "rate_req_s": None if math.isinf(rate) else rate,
        "run": "inf/s" if math.isinf(rate) else f"{rate:g}/s",
        "requests": n,
        "served_output_tok_s": client.get("throughput_tok_s"),
        "ttft_p50_s": client.get("ttft_p50_s"),
        "ttft_p99_s": client.get("ttft_p99_s"),
        "tbt_p50_s": client.get("tbt_p50_s"),
        "ok": client.get("ok"),
        "errors": client.get("errors"),
        "client_errors": served["errors"],
        "cpu_s": served["cpu_s"],
        "served_steps": served["steps"],
    }
    if offline is not None:
        row["offline_output_tok_s"] = offline["output_tok_s"]
        row["offline_wall_s"] = offline["wall_s"]
        tok = row["served_output_tok_s"]
        off = offline["output_tok_s"]
        row["served_over_offline"] = tok / off if tok and off else None
        row["bands"] = steps_by_band(served["_rows"], offline["_steps"])
    else:
        row["bands"] = steps_by_band(served["_rows"], [])
    return row
