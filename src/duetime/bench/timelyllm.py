"""`duetime bench timelyllm`: TimelyLLM's evaluation (§7) on LRTrace WID1–WID3, simulated.

Systems compared (``../shared/seeds/timelyllm.txt`` §7.1, §7.3.2):

- ``vllm``: FCFS continuous batching on *unsegmented* jobs; the robot gets
  the whole plan when generation finishes (every segment delivered at finish);
- ``vllm-stream``: the same FCFS schedule, but each segment is sent to the
  robot as soon as it is generated (policy ``vllm-stream``: never holds a
  generation at a boundary);
- ``fcfs-seg`` / ``edf-seg``: segmented generation with FCFS / EDF order
  (our ``fcfs`` and ``edf`` policies on segmented jobs: a suspended
  generation keeps its initial priority and resumes when the robot wants it);
- ``timelyllm``: the PUD policy (``duetime.policies.pud``).

Scoring (:func:`robot_outcome`) follows the robot, not the executor: the
robot starts action ``k`` at ``S_k = max(D_k, S_{k−1} + E_{k−1})`` where
``D_k`` is when segment ``k`` reached it and ``E`` the action times; segment
waiting ``W_0 = S_0 − arrival`` (the response time), ``W_k = S_k − (S_{k−1}
+ E_{k−1})``; utility ``TUF0(W_0) + Σ TUF1(W_k)`` (Eq. 3); waiting time
``Σ W_k`` (the paper's "completion time minus execution time").

The default cost model, ``paper-rtx4090``, is built from the paper's Table 1
(Llama3-8B fp16 on an RTX 4090: ~22 ms per decode step, 2,884 prompt tokens
prefilled in ~328 ms) plus roofline guesses for the per-sequence and KV
terms; it is a model, not a measurement. Any shipped profile works too.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from duetime.core.cost import LinearStepCost
from duetime.core.request import Job
from duetime.core.sequence import DecodeClock, Seq, SeqStatus
from duetime.core.snapshot import EngineSnapshot
from duetime.sim.simulator import SimConfig

SYSTEMS = ("vllm", "vllm-stream", "fcfs-seg", "edf-seg", "timelyllm")
_POLICY = {
    "vllm": "fcfs",
    "vllm-stream": "vllm-stream",
    "fcfs-seg": "fcfs",
    "edf-seg": "edf",
    "timelyllm": "timelyllm",
}
BASELINE = "vllm"
PAPER = {"utility_gain_best_x": 1.97, "waiting_reduction_best_pct": 84.0, "schedule_ms_8": 2.03}


def paper_rtx4090() -> tuple[LinearStepCost, SimConfig]:
    """Step costs modelled on TimelyLLM Table 1 (Llama3-8B fp16, RTX 4090, 24 GB)."""
    cost = LinearStepCost(
        c0=0.0215,  # decode step at batch 1 (Table 1: 21.6–21.9 ms)
        a1=(0.328 - 0.0215) / 2884,  # prefill of 2,884 tokens in 328 ms
        b=5e-4,  # per-sequence decode compute (guess)
        d=1.4e-7,  # 128 KiB KV per token (GQA) read at ~0.9 TB/s
        s=9.5e-3 / (170.35e6 / 131_072),  # §4.1: 170.35 MB of KV moves host→HBM in 9.5 ms
        name="paper-rtx4090",
    )
    # (24 GB − 16 GB weights − ~2 GB activations) / 128 KiB per token
    return cost, SimConfig(kv_capacity=45_000, max_num_seqs=256, max_batch_tokens=8192)


def _cost(
    profile: str,
    kv_capacity: int | None,
    max_num_seqs: int | None = None,
    offload: bool = True,
) -> tuple[Any, SimConfig]:
    if profile == "paper-rtx4090":
        cost, cfg = paper_rtx4090()
    else:
        from duetime.sim.profiles import load_profile

        cost, cfg = load_profile(profile)
    if kv_capacity is not None:
        cfg = dataclasses.replace(cfg, kv_capacity=kv_capacity)
    if max_num_seqs is not None:
        cfg = dataclasses.replace(cfg, max_num_seqs=max_num_seqs)
    return cost, dataclasses.replace(cfg, offload_suspended=offload)


def kv_needed(wids: tuple[int, ...], seed: int) -> tuple[int, int, Job]:
    """The smallest KV budget (tokens) every task of ``wids`` fits, with the workload and
    task that set it: a task holds its prompt and whole answer at once, less the newest
    token (produced, never fed back); one that cannot never finishes."""
    from duetime.workloads.lrtrace import lrtrace_jobs

    tasks = (
        (j.request.prompt_len + j.output_len - 1, w, j)
        for w in wids
        for j in lrtrace_jobs(w, seed=seed)
    )
    return max(tasks, key=lambda t: t[0])  # the first of the largest


def check_fits(wids: tuple[int, ...], seed: int, kv_capacity: int, source: str) -> None:
    """Refuse a KV budget some task cannot fit (it would never finish), naming the
    smallest that works. ``source``: where the budget came from, for the message."""
    need, w, j = kv_needed(wids, seed)
    if kv_capacity < need:
        raise ValueError(
            f"{source} {kv_capacity:,} is too small: the smallest that works is {need:,} KV "
            f"tokens (task {j.request.rid} of WID{w} holds its {j.request.prompt_len}-token "
            f"prompt and {j.output_len}-token answer at once, less the last token)"
        )


def robot_outcome(job: Job, done: list[float]) -> tuple[float, float, float]:
    """(utility, response time, waiting time) of one task from its delivery times ``done``."""
    req = job.request
    tuf = req.tuf
    assert tuf is not None
    later = tuf.later_segment()
    start = done[0]
    response = start - req.arrival
    util = tuf(response)
    wait = response
    for k in range(1, len(done)):
        want = start + job.segment_gaps[k - 1]  # robot finished action k − 1
        start = max(done[k], want)
        util += later(start - want)
        wait += start - want
    return util, response, wait


def _unsegmented(jobs: list[Job]) -> list[Job]:
    return [Job(dataclasses.replace(j.request), j.output_len) for j in jobs]


def run_system(
    system: str,
    wid: int,
    seed: int,
    profile: str,
    kv_capacity: int | None,
    max_num_seqs: int | None = None,
    offload: bool = True,
) -> dict[str, Any]:
    """Simulate one system on one workload and score it on the robot side."""
    from duetime.policies import make_policy
    from duetime.sim import Simulator
    from duetime.workloads.lrtrace import lrtrace_jobs

    jobs = lrtrace_jobs(wid, seed=seed)
    cost, cfg = _cost(profile, kv_capacity, max_num_seqs, offload)
    run_jobs = _unsegmented(jobs) if system == "vllm" else jobs
    sim = Simulator(make_policy(_POLICY[system]), cost, cfg)
    res = sim.run(run_jobs)
    row: dict[str, Any] = {
        "wid": wid,
        "system": system,
        "policy": _POLICY[system],
        "tasks": len(jobs),
        **score(system, jobs, res.records),
        "kv_peak_tokens": res.kv_peak,
        "kv_capacity_tokens": cfg.kv_capacity,
        "max_num_seqs": cfg.max_num_seqs,
        "prefill_tokens": sim.prefill_tokens,
        "offloads": res.counters.get("offloads", 0),
        "preemptions": res.preemptions,
        "policy_calls": res.policy_calls,
        "sim_time_s": res.sim_time,
        "wall_s": res.wall_s,
    }
    return row


def score(system: str, jobs: list[Job], records: list[Any]) -> dict[str, Any]:
    """Robot-side totals and per-class means of one run (any executor's records)."""
    per: dict[str, list[tuple[float, float, float]]] = {}
    for job, rec in zip(jobs, records, strict=True):
        assert rec.completed, f"task {job.request.rid} did not finish"
        n = max(len(job.segments), 1)
        done = [rec.finish] * n if system == "vllm" else list(rec.segment_done)
        per.setdefault(job.request.klass, []).append(robot_outcome(job, done))
    everything = [o for v in per.values() for o in v]
    return {**_stats(everything), "classes": {k: _stats(v) for k, v in sorted(per.items())}}


def _stats(outs: list[tuple[float, float, float]]) -> dict[str, float]:
    u, r, w = (np.array(x) for x in zip(*outs, strict=True))
    return {
        "time_utility_total": float(u.sum()),
        "time_utility_mean": float(u.mean()),
        "response_time_mean_s": float(r.mean()),
        "waiting_time_mean_s": float(w.mean()),
    }


def _gain(v: float, base: float) -> float | None:
    return v / base if base > 0 else None


def overhead_snapshot(n: int) -> EngineSnapshot:
    """``n`` queued tasks for :func:`overhead`: half new (waiting), half suspended
    segments ready to resume (due now), eight sequences decoding; free KV is the
    profile's whole capacity on top of what they hold, so a call ranks every
    candidate and admits what the step takes instead of preempting."""
    from duetime.core.request import Request
    from duetime.workloads.lrtrace import TUF_NORMAL, TUF_URGENT

    cost, cfg = paper_rtx4090()
    clock = DecodeClock()
    waiting, suspended, running = [], [], []
    for i in range(n + 8):
        tuf = TUF_URGENT if i % 3 == 0 else TUF_NORMAL
        req = Request(rid=i, arrival=0.01 * i, prompt_len=300, tuf=tuf)
        s = Seq(req, clock, i)
        if i >= n:
            s.status, s.prefilled = SeqStatus.RUNNING, 300
            s._start_decoding()
            running.append(s)
        elif i % 2:
            s.status, s.prefilled, s.segment_index = SeqStatus.SUSPENDED, 300, 1
            s._set_generated(6)
            s.ready_at = 5.0 - 0.001 * i
            suspended.append(s)
        else:
            waiting.append(s)
    held = sum(s.kv_tokens for s in running + suspended)
    return EngineSnapshot(
        now=5.0,
        waiting=waiting,
        running=running,
        prefilling=[],
        suspended=suspended,
        kv_capacity=cfg.kv_capacity + held,
        kv_free=cfg.kv_capacity,
        max_num_seqs=cfg.max_num_seqs,
        max_batch_tokens=cfg.max_batch_tokens,
        num_decoding=8,
        cost=cost,
    )


def overhead(sizes: tuple[int, ...] = (8, 64, 512), repeats: int = 50) -> dict[str, float]:
    """Median wall time of one ``TimelyLLM.schedule`` call on :func:`overhead_snapshot`
    (ms). Printed by the bench, never asserted."""
    from duetime.policies import make_policy

    out: dict[str, float] = {}
    for n in sizes:
        snap = overhead_snapshot(n)
        pol = make_policy("timelyllm")
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            pol.schedule(snap)
            times.append(time.perf_counter() - t0)
        out[f"schedule_ms_{n}"] = statistics.median(times) * 1e3
    return out


def run(
    wids: tuple[int, ...] = (1, 2, 3),
    seed: int = 0,
    profile: str = "paper-rtx4090",
    kv_capacity: int | None = None,
    max_num_seqs: int | None = None,
    offload: bool = True,
) -> dict[str, Any]:
    """Every system on every workload, gains vs vLLM, and the scheduling overhead; a KV
    budget some task cannot fit is refused (:func:`check_fits`) before any run."""
    t0 = time.perf_counter()
    _, cfg = _cost(profile, kv_capacity, max_num_seqs, offload)
    source = "--kv-capacity" if kv_capacity is not None else f"profile {profile}'s KV capacity"
    check_fits(wids, seed, cfg.kv_capacity, source)
    rows = [
        run_system(s, w, seed, profile, kv_capacity, max_num_seqs, offload)
        for w in wids
        for s in SYSTEMS
    ]
    return {
        "profile": profile,
        "kv_capacity_tokens": rows[0]["kv_capacity_tokens"],
        "max_num_seqs": rows[0]["max_num_seqs"],
        "offload_suspended": offload,
        "seed": seed,
        "baseline": BASELINE,
        "rows": rows,
        "summary": add_gains(rows, wids),
        "overhead": overhead(),
        "paper": PAPER,
        "wall_s": time.perf_counter() - t0,
    }


def add_gains(rows: list[dict[str, Any]], wids: tuple[int, ...]) -> dict[str, Any]:
    """Gains vs ``vllm`` into every row (and class); TimelyLLM's per-workload summary."""
    summary: dict[str, Any] = {}
    for w in wids:
        base = next(r for r in rows if r["wid"] == w and r["system"] == BASELINE)
        for r in rows:
            if r["wid"] != w:
                continue
            r["utility_gain_vs_fcfs_x"] = _gain(r["time_utility_total"], base["time_utility_total"])
            r["waiting_change_vs_fcfs_pct"] = 100.0 * (
                r["waiting_time_mean_s"] / base["waiting_time_mean_s"] - 1.0
            )
            for k, c in r["classes"].items():
                b = base["classes"][k]
                c["utility_gain_vs_fcfs_x"] = _gain(c["time_utility_mean"], b["time_utility_mean"])
                c["waiting_change_vs_fcfs_pct"] = 100.0 * (
                    c["waiting_time_mean_s"] / b["waiting_time_mean_s"] - 1.0
                )
        t = next(r for r in rows if r["wid"] == w and r["system"] == "timelyllm")
        gains = [c["utility_gain_vs_fcfs_x"] for c in t["classes"].values()]
        summary[f"wid{w}"] = {
            "utility_gain_vs_fcfs_x": t["utility_gain_vs_fcfs_x"],
            "utility_gain_best_class_x": max((g for g in gains if g is not None), default=None),
            "waiting_change_vs_fcfs_pct": t["waiting_change_vs_fcfs_pct"],
            "waiting_change_best_class_pct": min(
                c["waiting_change_vs_fcfs_pct"] for c in t["classes"].values()
            ),
        }
    return summary


def table(fig: dict[str, Any]) -> Any:
    """One rich table: per workload and system, totals and per-class mean utility."""
    from rich.table import Table

    classes = sorted({k for r in fig["rows"] for k in r["classes"]})
    t = Table(
        title=f"TimelyLLM on LRTrace, profile {fig['profile']}, KV {fig['kv_capacity_tokens']:,}"
        f" tokens, max_num_seqs {fig['max_num_seqs']}",
        caption="utility: Eq. 3 total; per class: mean per task; times: means in s; "
        "gain and waiting change vs vllm (FCFS)",
    )
    for col in ("WID", "system", "utility", "gain", "resp s", "wait s", "Δwait"):
        t.add_column(col, justify="left" if col == "system" else "right", no_wrap=True)
    for k in classes:
        t.add_column(f"U {k}", justify="right", no_wrap=True)
    for r in fig["rows"]:
        g = r["utility_gain_vs_fcfs_x"]
        t.add_row(
            str(r["wid"]),
            r["system"],
            f"{r['time_utility_total']:.1f}",
            "-" if g is None else f"{g:.2f}x",
            f"{r['response_time_mean_s']:.3f}",
            f"{r['waiting_time_mean_s']:.3f}",
            f"{r['waiting_change_vs_fcfs_pct']:+.0f}%",
            *(
                f"{r['classes'][k]['time_utility_mean']:.2f}" if k in r["classes"] else ""
                for k in classes
            ),
        )
    return t


def plot(fig: dict[str, Any], path: str | Path, title: str | None = None) -> Path:
    """Per workload: mean utility per task class and system (top), mean response and
    waiting time per system (bottom)."""
    from matplotlib.figure import Figure

    from duetime.metrics.atomic import save_png

    wids = sorted({r["wid"] for r in fig["rows"]})
    f = Figure(figsize=(5.0 * len(wids), 7.0))
    for i, w in enumerate(wids):
        ax = f.add_subplot(2, len(wids), i + 1)
        rows = [r for r in fig["rows"] if r["wid"] == w]
        classes = sorted(rows[0]["classes"])
        x = np.arange(len(classes))
        width = 0.8 / len(rows)
        for j, r in enumerate(rows):
            ys = [r["classes"][k]["time_utility_mean"] for k in classes]
            ax.bar(x + (j - (len(rows) - 1) / 2) * width, ys, width, label=r["system"])
        ax.axhline(0.0, color="k", lw=0.6)
        ax.set_xticks(x, classes)
        ax.set_ylabel("mean time utility per task (Eq. 3)")
        ax.set_title(f"WID{w}", fontsize=9)
        ax = f.add_subplot(2, len(wids), len(wids) + i + 1)
        x = np.arange(2)
        for j, r in enumerate(rows):
            ys = [r["response_time_mean_s"], r["waiting_time_mean_s"]]
            ax.bar(x + (j - (len(rows) - 1) / 2) * width, ys, width, label=r["system"])
        ax.set_xticks(x, ["response time", "robot waiting time"])
        ax.set_ylabel("mean per task (s)")
    f.suptitle(
        title
        or f"TimelyLLM vs baselines (simulated, {fig['profile']}, "
        f"max_num_seqs {fig['max_num_seqs']})",
        fontsize=10,
    )
    # One legend under the panels: inside one, it hid the bars it names.
    handles, labels = f.axes[0].get_legend_handles_labels()
    f.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8, frameon=False)
    f.tight_layout(rect=(0, 0.04, 1, 1))
    return save_png(f, path)
