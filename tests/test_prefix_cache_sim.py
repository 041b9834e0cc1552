"""Prefix caching in the simulator: the same books as the engine's, hits where it would hit."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from duetime.core.prefix_cache import PrefixCache
from duetime.core.request import Job, Request
from duetime.engine.executor import EngineExecutor
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy
from duetime.sim import SimConfig, Simulator
from duetime.workloads import SharedPrefix, SyntheticSource, build_jobs, read_trace, write_trace
from tests.factories import SIMPLE_COST, cli_refused, fresh_jobs

B = 16


def _group_job(rid: int, arrival: float, prompt: int, group: str | None, prefix: int) -> Job:
    req = Request(
        rid=rid,
        arrival=arrival,
        prompt_len=prompt,
        prefix_group=group,
        prefix_len=prefix if group else 0,
    )
    return Job(req, 4)


def _sim(jobs: list[Job], cache: int, tail: int = 1, **cfg: Any) -> Simulator:
    sim = Simulator(
        make_policy("fcfs"),
        SIMPLE_COST,
        SimConfig(prefix_cache_tokens=cache, prefix_compute_tail=tail, **cfg),
    )
    sim.run(fresh_jobs(jobs))
    return sim


@pytest.mark.parametrize("tail", [1, 32])
def test_requests_of_a_group_reuse_its_prefix_and_no_other(tail: int) -> None:
    """One request at a time (each done before the next arrives): the first of a group
    computes the prefix, every later one reuses its whole blocks, up to the tail a hit
    must leave; a request of another group, or of none, reuses nothing."""
    jobs = [
        _group_job(0, 0.0, 150, "a", 100),
        _group_job(1, 10.0, 120, "a", 100),
        _group_job(2, 20.0, 101, "a", 100),  # only 101 - tail tokens may be cached
        _group_job(3, 30.0, 150, "b", 100),
        _group_job(4, 40.0, 150, None, 0),
        _group_job(5, 50.0, 200, "b", 100),
    ]
    sim = _sim(jobs, cache=4096, tail=tail)
    got = [sim.records[j.request.rid].cached_prompt_tokens for j in jobs]

    def usable(prompt: int) -> int:  # whole blocks of the 96-token prefix before the tail
        return min(96, (prompt - tail) // B * B)

    assert got == [0, usable(120), usable(101), 0, 0, usable(200)]
    assert sim.prefill_cached_tokens == sum(got)
    assert sim.prefill_tokens + sim.prefill_cached_tokens == sum(j.request.prompt_len for j in jobs)
    assert not sim._chains  # every finished request let go of its chain


def test_a_cached_prefix_shortens_the_time_to_first_token() -> None:
    jobs = [_group_job(i, 10.0 * i, 1000, "sys", 960) for i in range(4)]
    plain, cached = _sim(jobs, cache=0), _sim(jobs, cache=4096)
    for rid in (1, 2, 3):
        ttft = {
            name: sim.records[rid].first_token - sim.records[rid].request.arrival  # type: ignore[operator]
            for name, sim in (("plain", plain), ("cached", cached))
        }
        assert ttft["cached"] < 0.5 * ttft["plain"]
    assert plain.records[0].first_token == cached.records[0].first_token  # nothing to reuse yet


def test_a_budget_smaller_than_the_prefixes_drops_the_least_recently_used() -> None:
    """Two groups of six blocks each and a budget of eight blocks: group a is dropped
    from its end when b comes in, so a's next request finds only what is left."""
    jobs = [
        _group_job(0, 0.0, 100, "a", 96),
        _group_job(1, 10.0, 100, "b", 96),
        _group_job(2, 20.0, 100, "a", 96),
    ]
    sim = _sim(jobs, cache=8 * B)
    cache = sim.prefix_cache
    assert cache is not None
    assert cache.num_blocks <= 8
    assert sim.records[1].cached_prompt_tokens == 0
    # b's six blocks (and its own seventh, computed) pushed a's chain back to its start
    assert 0 < (sim.records[2].cached_prompt_tokens or 0) < 96
    assert cache.dropped_blocks > 0


def test_the_prefix_cache_is_off_by_default_and_refuses_a_negative_budget() -> None:
    sim = _sim([_group_job(0, 0.0, 100, "a", 96), _group_job(1, 5.0, 100, "a", 96)], cache=0)
    assert sim.prefix_cache is None
    assert [r.cached_prompt_tokens for r in sim.records.values()] == [0, 0]
    with pytest.raises(ValueError, match="prefix_cache_tokens"):
        Simulator(make_policy("fcfs"), SIMPLE_COST, SimConfig(prefix_cache_tokens=-1))
    with pytest.raises(ValueError, match="prefix_compute_tail"):
        Simulator(make_policy("fcfs"), SIMPLE_COST, SimConfig(prefix_compute_tail=0))


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("--prefix-cache", "15"), "--prefix-cache 15 holds no 16-token block"),
        (("--prefix-groups", "3"), "--prefix-groups draws among --shared-prefix system prompts"),
    ],
)
def test_prefix_options_that_change_nothing_are_refused(args: tuple[str, ...], words: str) -> None:
    """Each ran as if not given, and the JSON recorded it as the run's setting."""
    cli_refused("sim", "--requests", "20", *args, names=words)


def test_a_recomputed_request_reuses_its_own_prompt_and_answer() -> None:
    """Memory for one request at a time, two requests decoding: FCFS preempts the newer
    by recompute; back in, its prompt and the answer it had are in the cache (under
    keys of its own: no other request can reuse them)."""
    jobs = [_group_job(0, 0.0, 64, None, 0), _group_job(1, 0.0, 64, None, 0)]
    long = [Job(j.request, 80) for j in jobs]
    sim = _sim(long, cache=4096, kv_capacity=200)
    assert sim.preemptions > 0
    redone = [r for r in sim.records.values() if r.num_preemptions]
    assert redone
    assert all((r.cached_prompt_tokens or 0) >= 48 for r in redone)


# --- engine and simulator hit alike ----------------------------------------------------
@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=3))


@st.composite
def shared_prompt_runs(draw: Any) -> dict[str, Any]:
    """Jobs, all arriving at once (so neither executor's clock matters to FCFS), some
    starting with one of two shared beginnings, and the limits both executors get."""
    r = random.Random(draw(st.integers(0, 10_000)))
    shared = [[r.randrange(256) for _ in range(r.randint(16, 70))] for _ in range(2)]
    jobs = []
    for rid in range(draw(st.integers(2, 9))):
        body = [r.randrange(256) for _ in range(r.randint(1, 40))]
        pick = r.randrange(3)
        ids = tuple((shared[pick] if pick < 2 else []) + body)
        req = Request(rid=rid, arrival=0.0, prompt_len=len(ids), prompt_token_ids=ids)
        jobs.append(Job(req, r.randint(1, 24)))
    return {
        "jobs": jobs,
        "cache": draw(st.sampled_from([32, 96, 4096])),
        "kv_capacity": draw(st.sampled_from([150, 400, 10_000])),
        "max_num_seqs": draw(st.sampled_from([1, 3, 16])),
        "max_batch_tokens": draw(st.sampled_from([16, 50, 2048])),
        "eviction": draw(st.sampled_from(["snapkv", "streaming"])),
    }


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shared_prompt_runs())
def test_engine_and_simulator_cache_the_same_blocks(model: Any, run: dict[str, Any]) -> None:
    """The one rule of the architecture, for prefix caching: on the same jobs, under the
    same limits and policy, the simulator finds every hit the engine finds, block for
    block, and stores and drops the same number of blocks."""
    limits = {k: run[k] for k in ("kv_capacity", "max_num_seqs", "max_batch_tokens")}
    engine = EngineExecutor(
        make_policy("fcfs"),
        model,
        eviction=run["eviction"],
        prefix_cache_tokens=run["cache"],
        skip_idle=True,
        **limits,
    )
    eng = engine.run(fresh_jobs(run["jobs"]))
    tail = engine.prefix_compute_tail
    assert tail == (32 if run["eviction"] == "snapkv" else 1)
    sim = _sim(run["jobs"], run["cache"], tail, **limits)
    assert eng.preemptions == sim.preemptions
    for rec in eng.records:
        twin = sim.records[rec.request.rid]
        assert rec.cached_prompt_tokens == twin.cached_prompt_tokens, rec.request.rid
    a, b = engine.prefix_cache, sim.prefix_cache
    assert a is not None
    assert b is not None
    figures = ("queried_tokens", "hit_tokens", "stored_blocks", "dropped_blocks", "num_blocks")
    assert {f: getattr(a, f) for f in figures} == {f: getattr(b, f) for f in figures}
    assert not engine._chains
    assert not sim._chains


# --- workloads: shared prefixes by name --------------------------------------------------
def test_build_jobs_puts_a_group_s_prefix_in_front_of_every_prompt() -> None:
    source = SyntheticSource(prompt_len=(5, 30), output_len=8)
    plain = build_jobs(40, source=source, seed=2)
    shared = build_jobs(40, source=source, seed=2, shared_prefix=SharedPrefix(64, groups=3))
    with_ids = build_jobs(
        40, source=source, seed=2, shared_prefix=SharedPrefix(64, groups=3), with_prompt_ids=True
    )
    groups = {j.request.prefix_group for j in shared}
    assert groups == {"shared-0", "shared-1", "shared-2"}
    for a, b, c in zip(plain, shared, with_ids, strict=True):
        assert b.request.prompt_len == a.request.prompt_len + 63  # <bos> is the prompt's own
        assert b.request.prefix_len == 64
        assert c.request.prompt_len == b.request.prompt_len
        assert c.request.prefix_group == b.request.prefix_group
    by_group: dict[str, set[tuple[int, ...]]] = {}
    for c in with_ids:
        ids = c.request.prompt_token_ids
        assert ids is not None
        assert ids[0] == 2
        by_group.setdefault(c.request.prefix_group or "", set()).add(ids[:64])
    assert all(len(prefixes) == 1 for prefixes in by_group.values())  # one prefix per group
    assert len({next(iter(p)) for p in by_group.values()}) == 3  # and different ones


def test_shared_prefix_caps_bound_the_whole_prompt() -> None:
    from duetime.workloads import LengthCaps

    jobs = build_jobs(
        50,
        source=SyntheticSource(prompt_len=(5, 150), output_len=(5, 300)),
        caps=LengthCaps(max_total_len=400),
        shared_prefix=SharedPrefix(200),
    )
    assert all(j.request.prompt_len + j.output_len <= 400 for j in jobs)
    with pytest.raises(ValueError, match=">= 2 tokens"):
        SharedPrefix(1)


def test_a_trace_keeps_prefix_groups_and_refuses_half_of_one(tmp_path: Path) -> None:
    from duetime.workloads import TraceError

    path = tmp_path / "t.jsonl"
    jobs = [_group_job(0, 0.0, 150, "sys", 100), _group_job(1, 1.0, 20, None, 0)]
    write_trace(path, jobs)
    back = read_trace(path)
    assert [(j.request.prefix_group, j.request.prefix_len) for j in back] == [
        ("sys", 100),
        (None, 0),
    ]
    line = {"rid": 0, "arrival": 0.0, "prompt_len": 50, "output_len": 4}
    for extra, field, words in (
        ({"prefix_group": "sys"}, "prefix_group", "without prefix_len"),
        ({"prefix_len": 10}, "prefix_len", "without prefix_group"),
        ({"prefix_group": "sys", "prefix_len": 51}, "prefix_len", "<= prompt_len"),
        ({"prefix_group": "", "prefix_len": 5}, "prefix_group", "must not be empty"),
    ):
        path.write_text(json.dumps(line | extra) + "\n")
        with pytest.raises(TraceError, match=f"field '{field}'.*{words}"):
            read_trace(path)


def test_request_refuses_a_prefix_longer_than_its_prompt() -> None:
    with pytest.raises(ValueError, match="prefix_len"):
        Request(rid=0, arrival=0.0, prompt_len=10, prefix_group="a", prefix_len=11)
    with pytest.raises(ValueError, match="without a prefix_group"):
        Request(rid=0, arrival=0.0, prompt_len=10, prefix_len=4)


# --- `duetime sim --prefix-cache` -------------------------------------------------------
def test_sim_cli_reports_the_cached_share_and_faster_first_tokens(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from duetime.cli import app

    figures = {}
    for cache in (0, 65_536):
        path = tmp_path / f"{cache}.json"
        args = ["sim", "--workload", "synthetic", "--requests", "300", "--rate", "2"]
        args += ["--shared-prefix", "512", "--prefix-groups", "2", "--prefix-cache", str(cache)]
        res = CliRunner().invoke(app, [*args, "--json", str(path)])
        assert res.exit_code == 0, res.output
        figures[cache] = json.loads(path.read_text())
    plain, cached = figures[0]["summary"], figures[65_536]["summary"]
    assert plain["prompt_cached_pct"] == 0.0
    assert 20.0 < cached["prompt_cached_pct"] < 100.0
    assert cached["ttft_p50_s"] < plain["ttft_p50_s"]
    assert figures[65_536]["spec"]["prefix_cache"] == 65_536
    assert "of prompt tokens were cached" in res.output


def test_sim_cli_refuses_a_shared_prefix_on_a_trace(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, [_group_job(0, 0.0, 150, "sys", 100)])
    cli_refused("sim", "--workload", str(path), "--shared-prefix", "64", names="--shared-prefix")
    cli_refused("sim", "--prefix-cache", "-1", names="--prefix-cache")


def test_a_keys_only_cache_holds_no_bytes() -> None:
    cache: PrefixCache[None] = PrefixCache(64)
    assert cache.insert(("prefix", "a", 0), b"", None)
    assert cache.nbytes == 0
    assert cache.num_tokens == B


# Found by the property above: a simulator that offers a decoder's blocks
# all at the end of a decode run keeps, with the cache full, another block than the
# engine, which offers each in the step that completes it.
_DECODE_BLOCKS_RUN = [  # (answer tokens, prompt ids as hex bytes)
    (
        23,
        "a15ef6f15a1d830bb7ce09d6bbc004e7175c643c7decb0b580ec37bc9712dd2e"
        "6aaeb94bae8d2f9fa29c5a284c9e521829cf1079b080e9d74a1c10fcab6a4243"
        "d33656debe4c1ed79648e856e8",
    ),
    (
        23,
        "f58c95f0ce4b39c15bffad5c2dfb8bb820b6119cba",
    ),
    (
        23,
        "82b70eee7f1a5039bef07ec2347f066ed08f5dc7512447e3404300026b6e5455"
        "94a065685d64c4980bb8d4544a8721a99a01ad219eb59cf88796ae5b05f280a6"
        "8ced93b6b28cb0d1b3",
    ),
    (
        16,
        "82b70eee7f1a5039bef07ec2347f066ed08f5dc7512447e3404300026b6e5455"
        "94a065685d64c4980bb8d4544a8721a99a01ad219eb59cbaab485565b9f49028"
        "d557d79a8a0e6451e15c705c15f173541b4438a2",
    ),
    (
        4,
        "a15ef6f15a1d830bb7ce09d6bbc004e7175c643c7decb0b580ec37bc9712dd2e"
        "6aaeb94bae8d2f9fa29c5a284c9e12d4eeb3c2246879bf00b3cf8e",
    ),
]


def test_blocks_a_decode_run_completes_go_in_in_the_order_of_their_steps(model: Any) -> None:
    jobs = []
    for rid, (out, hexed) in enumerate(_DECODE_BLOCKS_RUN):
        ids = tuple(bytes.fromhex(hexed))
        jobs.append(
            Job(Request(rid=rid, arrival=0.0, prompt_len=len(ids), prompt_token_ids=ids), out)
        )
    limits = {"kv_capacity": 150, "max_num_seqs": 3, "max_batch_tokens": 50}
    engine = EngineExecutor(
        make_policy("fcfs"),
        model,
        eviction="snapkv",
        prefix_cache_tokens=96,
        skip_idle=True,
        **limits,
    )
    engine.run(fresh_jobs(jobs))
    sim = _sim(jobs, 96, engine.prefix_compute_tail, **limits)
    a, b = engine.prefix_cache, sim.prefix_cache
    assert a is not None
    assert b is not None
    assert (a.stored_blocks, a.dropped_blocks) == (b.stored_blocks, b.dropped_blocks)
