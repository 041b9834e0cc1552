"""Log-probabilities of answer tokens: the engine's record, and its formats in the API."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from duetime.core.request import Job, Request
from duetime.engine.executor import EngineExecutor
from duetime.engine.logprobs import LogprobLog, TokenLogprob
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from duetime.policies import make_policy
from duetime.server.codec import ByteCodec
from duetime.server.logprob_format import (
    FLOOR,
    LoggedToken,
    chat_logprobs,
    completion_logprobs,
)


def test_a_record_is_the_rows_log_softmax_and_its_likeliest_tokens() -> None:
    logits = torch.tensor([1.0, 3.0, 2.0, -torch.inf])
    log = LogprobLog(top_n=2)
    log.record(0, logits, 2)
    want = torch.log_softmax(logits, 0)
    (e,) = log.entries
    assert e.token == 2
    assert e.logprob == pytest.approx(float(want[2]))
    assert [i for i, _ in e.top] == [1, 2]
    assert e.top[0][1] == pytest.approx(float(want[1]))
    log.record(0, torch.zeros(4), 3)  # a replayed position keeps the entry given out
    assert log.entries == [e]
    with pytest.raises(ValueError, match="skips ahead"):
        log.record(2, logits, 0)
    with pytest.raises(ValueError, match="top_n"):
        LogprobLog(top_n=21)


def test_the_formats_floor_minus_infinity_and_keep_the_chosen_token() -> None:
    codec = ByteCodec()
    a, b = codec.OFFSET + ord("a"), codec.OFFSET + ord("b")
    tokens = [
        LoggedToken(TokenLogprob(a, -0.5, ((a, -0.5), (b, -1.0))), "a", 0),
        LoggedToken(TokenLogprob(b, -math.inf, ((a, -0.1),)), "b", 1),
    ]
    c = completion_logprobs(tokens, codec)
    assert c["tokens"] == ["a", "b"]
    assert c["token_logprobs"] == [-0.5, FLOOR]
    assert c["text_offset"] == [0, 1]
    assert c["top_logprobs"] == [{"a": -0.5, "b": -1.0}, {"a": -0.1, "b": FLOOR}]
    chat = chat_logprobs(tokens, codec)["content"]
    assert chat[0] == {
        "token": "a",
        "logprob": -0.5,
        "bytes": [97],
        "top_logprobs": [
            {"token": "a", "logprob": -0.5, "bytes": [97]},
            {"token": "b", "logprob": -1.0, "bytes": [98]},
        ],
    }
    assert chat[1]["logprob"] == FLOOR


@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=1))


def test_the_engine_logs_one_entry_per_answer_token_through_restarts(model: Any) -> None:
    r = random.Random(3)
    jobs = []
    for i in range(10):
        ids = tuple(r.randrange(256) for _ in range(r.randint(1, 40)))
        req = Request(rid=i, arrival=0.0, prompt_len=len(ids), prompt_token_ids=ids, max_tokens=64)
        jobs.append(Job(req, r.randint(4, 24)))

    def run(**kw: Any) -> tuple[Any, dict[int, LogprobLog]]:
        ex = EngineExecutor(kw.pop("policy", make_policy("fcfs")), model, **kw)
        logs = {j.request.rid: LogprobLog(top_n=3) for j in jobs}
        ex.logprob_logs.update(logs)
        return ex.run(jobs), logs

    roomy, logs = run(kv_capacity=10_000)
    for rid, out in roomy.outputs.items():
        entries = logs[rid].entries
        assert [e.token for e in entries] == out
        for e in entries:
            assert e.top[0][0] == e.token  # greedy: the chosen token is the likeliest
            assert e.logprob == pytest.approx(e.top[0][1])
            assert [v for _, v in e.top] == sorted((v for _, v in e.top), reverse=True)
            assert sum(math.exp(v) for _, v in e.top) <= 1 + 1e-5
    tight, tight_logs = run(
        policy=make_policy("fcfs", preempt_mode="restart"), kv_capacity=120, max_batch_tokens=32
    )
    assert tight.counters.get("restarts", 0) > 0
    for rid, out in tight.outputs.items():  # a replayed token adds no second entry
        assert [e.token for e in tight_logs[rid].entries] == out
