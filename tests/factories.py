"""Small builders for requests, jobs and snapshots used across the tests, and the
hypothesis strategies that the simulator's and the engine's policy fuzzers share."""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import numpy as np
import torch
from hypothesis import strategies as st

from duetime.core.cost import LinearStepCost
from duetime.core.decision import Decision
from duetime.core.request import Job, Request
from duetime.core.snapshot import EngineSnapshot
from duetime.policies.base import QueuePolicy

SIMPLE_COST = LinearStepCost.batch(c=0.01, a=1e-4, b=1e-4, d=1e-6)


def job(
    rid: int,
    arrival: float = 0.0,
    prompt: int = 10,
    output: int = 5,
    deadline: float | None = None,
    **req_kwargs: object,
) -> Job:
    req = Request(rid=rid, arrival=arrival, prompt_len=prompt, deadline=deadline, **req_kwargs)  # type: ignore[arg-type]
    return Job(request=req, output_len=output)


def poisson_jobs(
    n: int,
    rate: float,
    seed: int = 0,
    prompt: tuple[int, int] = (10, 200),
    output: tuple[int, int] = (5, 200),
    slo: float | None = None,
) -> list[Job]:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1.0 / rate, n))
    ps = rng.integers(prompt[0], prompt[1] + 1, n)
    os_ = rng.integers(output[0], output[1] + 1, n)
    return [
        job(
            i,
            float(arr[i]),
            int(ps[i]),
            int(os_[i]),
            deadline=None if slo is None else float(arr[i]) + slo,
        )
        for i in range(n)
    ]


class EvictAfterPrefill(QueuePolicy):
    """FCFS that evicts ratio α of each request's KV right after its prefill; with
    ``swap`` it then swaps that request out for one step and back in, with ``cancel``
    it cancels it instead."""

    name = "evict-once"

    def __init__(self, alpha: float, swap: bool = False, cancel: bool = False) -> None:
        super().__init__(preempt_mode="swap" if swap else "recompute")
        self.alpha, self.swap, self.cancel = alpha, swap, cancel
        self.done: set[int] = set()
        self.swapped: set[int] = set()

    def schedule(self, snap: EngineSnapshot) -> Decision:
        dec = super().schedule(snap)
        for s in snap.running:
            if s.prefill_done and s.rid not in self.done and s.rid not in dec.preempt:
                dec.evict[s.rid] = self.alpha
                self.done.add(s.rid)
            elif self.cancel and s.rid in self.done:
                dec.cancel.append(s.rid)
            elif self.swap and s.rid in self.done and s.rid not in self.swapped:
                dec.preempt.append(s.rid)
                self.swapped.add(s.rid)
        return dec


def fresh_jobs(jobs: list[Job]) -> list[Job]:
    """Copies of ``jobs`` with new Requests and no prediction, for a second run of the
    same jobs (executors and predictors write into ``Request.predicted``)."""
    out = [
        Job(
            Request(**{f: getattr(j.request, f) for f in j.request.__dataclass_fields__}),
            j.output_len,
            j.segments,
            j.segment_gaps,
        )
        for j in jobs
    ]
    for j in out:
        j.request.predicted = None  # type: ignore[misc]
    return out


def answer_shape_problems(
    n: int, reason: str, max_tokens: int, timing: dict[str, Any]
) -> list[str]:
    """What is wrong with an answer's token count, finish reason and TTFT / e2e timing
    (the server tests judge every answer by these before their own checks)."""
    bad = []
    if n > max_tokens or (reason == "length" and n != max_tokens):
        bad.append(f"{n} tokens, finish {reason}, max_tokens {max_tokens}")
    ttft, e2e = timing["ttft_ms"], timing["e2e_ms"]
    if n > 0 and ttft is None:
        bad.append(f"{n} tokens and no ttft")
    if ttft is not None and not 0 <= ttft <= e2e:
        bad.append(f"ttft {ttft} ms, e2e {e2e} ms")
    return bad


def prometheus_samples(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` of a Prometheus text exposition (comments skipped)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def byte_codec_text(ids: Sequence[int], *, final: bool) -> str:
    """The byte codec's text of ``ids`` as a client may have it: with ``final=False`` a
    character still missing bytes is left out; a broken byte is U+FFFD either way."""
    from duetime.server.codec import ByteCodec

    data = bytes(i - ByteCodec.OFFSET for i in ids if ByteCodec.OFFSET <= i < ByteCodec.vocab_size)
    return codecs.getincrementaldecoder("utf-8")("replace").decode(data, final=final)


def cli_refused(*args: str, names: str, value: str | None = None) -> str:
    """Run ``duetime *args``; assert exit 2, no traceback, and ``names`` (and ``value``) in
    the output. Returns the output with rich's error box unfolded into one line of words,
    which is what ``names`` is matched against (a long message wraps inside the box)."""
    from typer.testing import CliRunner

    from duetime.cli import app

    res = CliRunner().invoke(app, list(args))
    output = " ".join(res.output.replace("│", " ").split())
    assert res.exit_code == 2, res.output
    assert "Traceback" not in output
    assert names in output, output
    if value is not None:
        assert value in output, output
    return output


def record_evictions(policy: Any) -> set[int]:
    """Wrap ``policy.schedule`` so that the returned set collects every request the
    policy evicts KV from (ratio > 0): its answer may change, not its length."""
    evicted: set[int] = set()
    schedule = policy.schedule

    def recording(snap: EngineSnapshot) -> Decision:
        dec = schedule(snap)
        evicted.update(rid for rid, alpha in dec.evict.items() if alpha > 0)
        return dec

    policy.schedule = recording
    return evicted


T = TypeVar("T")


def on_threads(n: int, fn: Callable[[], T]) -> T:
    """``fn()`` with torch on ``n`` threads, the setting restored after (kernels that
    split work over threads must not change their result)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(n)
        return fn()
    finally:
        torch.set_num_threads(before)


def tiny_engine_profile(model: Any, path: Any) -> str:
    """A profile of ``model``'s quick grid written to ``path`` (10,000 KV tokens, 8
    sequences, 64-token steps); its path, as `validate` takes it."""
    import json

    from duetime.engine.profile import ProfileGrid, measure_steps
    from duetime.predict.cost_report import profile_payload

    payload = profile_payload(
        measure_steps(model, ProfileGrid.quick()), name="tiny", source="test",
        kv_capacity_tokens=10_000, max_num_seqs=8, max_batch_tokens=64,
    )  # fmt: skip
    path.write_text(json.dumps(payload))
    return str(path)


def forbid_model_loads(monkeypatch: Any) -> None:
    """Make any model load (real, GGUF, tiny, served) fail loudly: for checks that must
    refuse bad options before the model loads."""

    def loaded(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a model was loaded before the options were checked")

    import duetime.bench.serve
    import duetime.engine
    import duetime.engine.load
    import duetime.engine.testing
    import duetime.engine.weights
    import duetime.server.build

    monkeypatch.setattr(duetime.engine.load, "load_model", loaded)
    monkeypatch.setattr(duetime.engine, "load_model", loaded)
    monkeypatch.setattr(duetime.engine.weights, "load_weights", loaded)
    monkeypatch.setattr(duetime.engine.testing, "engine_from_hf", loaded)
    monkeypatch.setattr(duetime.bench.serve, "load_served_model", loaded)
    monkeypatch.setattr(duetime.server.build, "load_served_model", loaded)


#: Options drawn per policy (each a strategy of keyword arguments).
POLICY_OPTIONS: dict[str, st.SearchStrategy[dict[str, Any]]] = {
    "fcfs": st.fixed_dictionaries(
        {
            "chunked_prefill": st.booleans(),
            "head_of_line_blocking": st.booleans(),
            "preempt_mode": st.sampled_from(["recompute", "swap", "restart"]),
        }
    ),
    "deferred-prefill": st.fixed_dictionaries(
        {"k": st.integers(1, 6), "stall_decode": st.booleans()}
    ),
    "timebill": st.fixed_dictionaries(
        {
            "overrun": st.sampled_from(["kill", "skip-next"]),
            "fixed_alpha": st.sampled_from([None, 0.0, 0.5]),
            "batch_aware": st.booleans(),
        }
    ),
    "timelyllm": st.fixed_dictionaries(
        {"segment_tokens": st.integers(1, 20), "latency_guard": st.booleans()}
    ),
    "amax": st.fixed_dictionaries({"seed": st.integers(0, 9)}),
    "hsf": st.fixed_dictionaries({"seed": st.integers(0, 9)}),
}


def maybe_two_segments(
    draw: st.DrawFn, output: int, gap: st.SearchStrategy[float]
) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """No segments, or (for 2+ tokens, half the time) the output cut in two with a drawn gap."""
    if output >= 2 and draw(st.booleans()):
        cut = draw(st.integers(1, output - 1))
        return (cut, output - cut), (draw(gap),)
    return (), ()
