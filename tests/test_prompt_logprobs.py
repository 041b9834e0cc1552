"""The prompt's log-probabilities (``/v1/completions`` with ``echo`` and ``logprobs``).

What evaluation harnesses (lm-evaluation-harness's ``local-completions``) send to
score a continuation: the prompt as token ids, ``max_tokens`` 1, ``logprobs`` 1,
``echo``; they read ``token_logprobs`` and ``top_logprobs`` of the prompt's
positions. The engine scores them from the prefill's rows, chunked or not.
"""

from __future__ import annotations

import json
import random
from typing import Any

import httpx
import pytest
import torch

from duetime.core.request import Job, Request
from duetime.engine.batch import SeqChunk
from duetime.engine.executor import EngineExecutor
from duetime.engine.logprobs import LogprobLog, TokenLogprob
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy
from duetime.server.codec import ByteCodec
from duetime.server.logprob_format import joined, prompt_logprobs
from tests.served import MODEL, wait_idle


@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=1))


def _reference(model: Any, ids: list[int]) -> torch.Tensor:
    """log-softmax of every row of one whole forward of ``ids`` (no batching, no chunks)."""
    kv = model.new_kv_cache()
    logits = model.step([SeqChunk(kv.allocate(), ids, 0)], kv, all_logits=True)
    return torch.log_softmax(logits, dim=-1)


def test_prompt_entries_are_the_full_forward_s_rows_through_chunks_and_recomputes(
    model: Any,
) -> None:
    """Prompts prefilled in 16-token chunks beside other requests, scored 5 rows at a
    time, some preempted and recomputed: every prompt token after the first is scored
    once, as one whole forward of the prompt scores it."""
    r = random.Random(7)
    shared = [r.randrange(256) for _ in range(40)]
    jobs, logs = [], {}
    for rid in range(8):
        ids = shared + [r.randrange(256) for _ in range(r.randint(1, 30))] if rid % 2 else []
        ids = ids or [r.randrange(256) for _ in range(r.randint(1, 60))]
        req = Request(rid=rid, arrival=0.0, prompt_len=len(ids), prompt_token_ids=tuple(ids))
        jobs.append(Job(req, r.randint(2, 30)))
        if rid < 6:  # two requests score nothing: they keep their prefix-cache hits
            logs[rid] = LogprobLog(top_n=2, prompt=True)
    logs[7] = LogprobLog(top_n=2)  # answer log-probabilities only
    ex = EngineExecutor(
        make_policy("fcfs"),
        model,
        kv_capacity=150,
        max_batch_tokens=16,
        prefix_cache_tokens=4096,
        eviction="streaming",
    )
    ex.PROMPT_SCORE_ROWS = 5  # several pieces per chunk
    ex.logprob_logs.update(logs)
    res = ex.run(jobs)
    assert res.preemptions > 0  # some prefills were computed twice
    for job in jobs:
        rid, ids = job.request.rid, list(job.request.prompt_token_ids or ())
        log = logs.get(rid)
        if log is None or log.prompt_entries is None:
            continue
        entries = log.prompt_entries
        assert [e.token for e in entries] == ids[1:], rid
        want = _reference(model, ids)
        for i, e in enumerate(entries):
            assert e.logprob == pytest.approx(float(want[i, ids[i + 1]]), abs=1e-4)
            assert [t for t, _ in e.top] == torch.topk(want[i], 2).indices.tolist()
    records = {rec.request.rid: rec for rec in res.records}
    # a scored prefill takes no hit; a recomputed one, its prompt scored, may
    once = [rid for rid in range(6) if not records[rid].num_preemptions]
    assert once
    assert all(records[rid].cached_prompt_tokens == 0 for rid in once)
    assert (records[7].cached_prompt_tokens or 0) > 0  # the shared beginning, from the cache


def test_a_one_token_prompt_has_nothing_to_score(model: Any) -> None:
    log = LogprobLog(top_n=0, prompt=True)
    ex = EngineExecutor(make_policy("fcfs"), model)
    ex.logprob_logs[0] = log
    ex.run([Job(Request(rid=0, arrival=0.0, prompt_len=1, prompt_token_ids=(5,)), 3)])
    assert log.prompt_entries == []
    assert log.prompt_done(1)
    assert len(log.entries) == 3


def test_prompt_rows_must_continue_the_log() -> None:
    log = LogprobLog(top_n=1, prompt=True)
    with pytest.raises(ValueError, match="do not continue 0 entries"):
        log.record_prompt(1, torch.zeros(1, 4), [2])
    with pytest.raises(ValueError, match="do not continue None"):
        LogprobLog(top_n=1).record_prompt(0, torch.zeros(1, 4), [2])
    assert LogprobLog(top_n=1).prompt_positions(0, 10, 10) == range(0)
    assert log.prompt_positions(3, 20, 10) == range(3, 9)


def test_the_prompt_s_format_has_no_first_score_and_pieces_that_make_the_text() -> None:
    codec = ByteCodec()
    ids = codec.encode("héllo")  # é is two bytes: two tokens, one character
    entries = [TokenLogprob(t, -0.25 * i, ((t, -0.25 * i),)) for i, t in enumerate(ids[1:])]
    got = prompt_logprobs(ids, entries, codec)
    text = codec.decode(ids)
    assert "".join(got["tokens"]) == text
    assert got["token_logprobs"][0] is None
    assert got["top_logprobs"][0] is None
    assert got["token_logprobs"][1:] == [e.logprob for e in entries]
    assert got["text_offset"] == [len("".join(got["tokens"][:i])) for i in range(len(ids))]
    assert "" in got["tokens"]  # the first byte of é: its text comes with the second
    # an answer that ended before its prefill: the positions it did not reach are null
    short = prompt_logprobs(ids, entries[:2], codec)
    assert short["token_logprobs"][3:] == [None] * (len(ids) - 3)
    both = joined(got, {k: [v[0]] for k, v in got.items()})
    assert len(both["tokens"]) == len(ids) + 1


def test_a_harness_s_echo_request_scores_its_prompt(served: tuple[str, Any]) -> None:
    """lm-evaluation-harness's loglikelihood request, whole and streamed, and n = 2."""
    url, state = served
    ids = state.codec.encode("Once upon a time")
    body = {
        "model": MODEL,
        "prompt": [ids],  # a batch of one id list, as the harness sends it
        "max_tokens": 1,
        "logprobs": 1,
        "echo": True,
        "temperature": 0,
    }
    whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
    (choice,) = whole["choices"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 1
    assert lp["token_logprobs"][0] is None
    assert lp["top_logprobs"][0] is None
    assert "".join(lp["tokens"]) == choice["text"]
    assert lp["text_offset"] == [len("".join(lp["tokens"][:i])) for i in range(len(ids) + 1)]
    wait_idle(state)
    want = _reference(state.engine.executor.model, ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(float(want[i - 1, ids[i]]), abs=1e-4)
        assert len(lp["top_logprobs"][i]) in (1, 2)  # the likeliest, and the prompt's own
    assert lp["token_logprobs"][-1] == pytest.approx(float(want[-1].max()), abs=1e-4)
    assert whole["usage"]["prompt_tokens_details"]["cached_tokens"] == 0

    events = []
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:]))
    first = events[0]["choices"][0]
    assert first["text"] == state.codec.decode(ids)  # the echo, sent with its scores
    parts = [e["choices"][0]["logprobs"] for e in events if e["choices"][0]["logprobs"]]
    assert [t for p in parts for t in p["tokens"]] == lp["tokens"]
    assert [v for p in parts for v in p["token_logprobs"]] == lp["token_logprobs"]
    assert [o for p in parts for o in p["text_offset"]] == lp["text_offset"]

    two = httpx.post(url + "/v1/completions", json={**body, "n": 2}, timeout=60).json()
    for c in two["choices"]:  # (two prompts in one step: the last bits may differ)
        assert c["logprobs"]["token_logprobs"][0] is None
        assert c["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:])
    wait_idle(state)


def test_a_plain_prompt_after_a_scored_one_still_hits_the_cache(served: tuple[str, Any]) -> None:
    """A scored prompt takes no hit but leaves its blocks for the next one."""
    url, state = served
    prompt = "The quick brown fox jumps over the lazy dog, " * 3
    scored = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "logprobs": 0, "echo": True}
    for _ in range(2):
        r = httpx.post(url + "/v1/completions", json=scored, timeout=60).json()
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    plain = httpx.post(
        url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 2}
    ).json()
    assert plain["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    wait_idle(state)
