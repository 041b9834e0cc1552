"""The gateway's forecast against a backend's cost model: its batch limit, the context its
answers are normalised at, and a profile given at start for a backend that publishes none."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from duetime.cli import app as cli_app
from duetime.core.cost import LinearStepCost
from duetime.server.gateway import Ask, Backend, GatewayConfig
from duetime.server.gateway_pool import Gateway
from duetime.server.gateway_profiles import ProfileReader
from tests.gateway_choice import offer

#: A model with a KV term large enough that the context a step attends moves its cost.
COST = LinearStepCost.batch(c=0.010, a=0.0005, b=0.004, d=0.00002)


def _published(b: Backend, **limits: Any) -> Backend:
    b.published.cost = COST
    b.published.body = {**COST.to_profile(), **limits}
    return b


def test_an_answer_forecasts_back_its_own_time_at_its_own_context() -> None:
    """An answer that ended with 3 in flight, normalised at its own context, prices the
    same request joining 2 others at the time it took: the pace is divided and multiplied
    by the model's slowdown at the same batch and the same context."""
    b = _published(Backend("http://a", up=True, in_flight=3))
    ask = Ask(64, prompt_len=400)
    b.observe(0.3, 0.3 + 64 * 0.05, 65, alpha=0.5, context=ask.context)
    b.in_flight = 2
    got = offer([b], ask, max_inflight=8)
    assert got.finish[0] == pytest.approx(0.3 + 64 * 0.05)
    # normalised at context 1 instead, the forecast would be off by the KV term
    c = Backend("http://c", up=True, in_flight=3)
    _published(c).observe(0.3, 0.3 + 64 * 0.05, 65, alpha=0.5)
    c.in_flight = 2
    assert offer([c], ask, max_inflight=8).finish[0] > got.finish[0] * 1.01


def test_the_forecast_batch_is_the_backends_own_limit_where_smaller() -> None:
    """A backend whose model runs 2 sequences at a time holds a third request in its own
    queue: with 3 in flight a new request waits for slots to free, whatever number of
    requests the gateway lets it hold."""
    ask = Ask(32, prompt_len=16)
    capped = _published(Backend("http://a", up=True, in_flight=3), max_num_seqs=2)
    open_ = _published(Backend("http://b", up=True, in_flight=3))
    got = offer([capped, open_], ask, max_inflight=60)
    ttft = COST.prefill_time(16)
    alone = COST.alone_time(16, 32)
    service2 = ttft + (alone - ttft) * capped.slowdown(2, ask.context)
    service4 = ttft + (alone - ttft) * open_.slowdown(4, ask.context)
    assert got.finish[0] == pytest.approx(2 * service2 / 2 + service2)
    assert got.finish[1] == pytest.approx(service4)
    assert capped.batch_slots(60) == 2
    assert capped.batch_slots(1) == 1
    assert open_.batch_slots(60) == 60


def test_the_first_token_waits_for_the_prompts_ahead_of_it() -> None:
    """Two streams sent to a backend have not had their first byte: a third prompt is
    priced behind both, each a prompt step beside the sequences decoding, after half of
    the step in progress; a 500 ms TTFT bound refuses it there and takes the idle backend."""
    ask = Ask(32, prompt_len=400, ttft_s=0.5)
    busy = _published(Backend("http://a", up=True, in_flight=6, prefilling=2))
    idle = _published(Backend("http://b", up=True))
    got = offer([busy, idle], ask, max_inflight=8)
    n, kv = 400, 4 * ask.context
    step = COST.step_time(n, float(n * n), 4, kv)
    assert got.first[0] == pytest.approx(0.5 * COST.decode_step(4, kv) + 3 * step)
    assert got.first[1] == pytest.approx(COST.step_time(n, float(n * n), 0, 0))
    assert got.first[0] > 0.5 >= got.first[1]
    assert list(got.snap.up) == [False, True]
    # without a cost model, each prompt ahead takes the moving average of the first token
    bare = Backend("http://c", up=True, in_flight=3, prefilling=2, ttft_s=0.1, observed=1)
    assert bare.first_token_time(400, 0.1, 3, ask.context) == pytest.approx(0.3)


def _profile_file(tmp_path: Path, body: dict[str, Any]) -> Path:
    p = tmp_path / "vllm.json"
    p.write_text(json.dumps(body))
    return p


def test_a_given_profile_prices_its_backend_and_is_not_read_again() -> None:
    body = {**COST.to_profile(), "name": "vllm-probed", "max_num_seqs": 4}
    gw = Gateway(["http://a", "http://b"], GatewayConfig(), {"http://a": body})
    a, b = gw.backends
    assert a.published.status == "given"
    assert a.published.cost is not None
    assert b.published.cost is None
    assert a.batch_slots(8) == 4
    assert a.estimates(16, 32) == pytest.approx((COST.prefill_time(16), COST.alone_time(16, 32)))
    health = ProfileReader(gw).health(a)
    assert health["status"] == "given"
    assert health["in_use"] is True
    assert health["name"] == "vllm-probed"


def test_the_cli_takes_a_profile_and_names_a_bad_one(tmp_path: Path) -> None:
    from duetime.cli.gateway import _load_profiles

    url = "http://127.0.0.1:9"
    good = _profile_file(tmp_path, COST.to_profile())
    assert _load_profiles([f"{url}={good}"], [url])[url]["coefficients"]
    bad = _profile_file(tmp_path, {"coefficients": {"c0": "fast"}})
    r = CliRunner().invoke(cli_app, ["gateway", "--backend", url, "--profile", f"{url}={bad}"])
    assert r.exit_code == 2
    assert str(bad) in r.output.replace("\n", "")
    assert "not a usable profile" in r.output
