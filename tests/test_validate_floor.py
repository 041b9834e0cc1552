"""`validate`'s e2e floor: the same requests through the real engine again, the error
between real runs beside the simulator's."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from duetime.bench import validate
from duetime.core.request import Job, Request
from duetime.engine.step_samples import steps_from_telemetry
from duetime.engine.testing import engine_from_hf, tiny_hf_model
from tests.factories import tiny_engine_profile


@pytest.fixture(scope="module")
def model() -> Any:
    return engine_from_hf(tiny_hf_model(seed=1))


def _jobs(n: int) -> list[Job]:
    r = random.Random(5)
    jobs = []
    for i in range(n):
        p = r.randint(1, 30)
        ids = tuple(r.randrange(256) for _ in range(p))
        req = Request(rid=i, arrival=0.01 * i, prompt_len=p, prompt_token_ids=ids, max_tokens=32)
        jobs.append(Job(req, r.randint(2, 16)))
    return jobs


def _rec(rid: int, e2e: float | None) -> Any:
    finish = None if e2e is None else 1.0 + e2e
    return SimpleNamespace(request=SimpleNamespace(rid=rid, arrival=1.0), e2e=e2e, finish=finish)


def test_the_floor_pools_every_repeated_run_against_the_first() -> None:
    first = [_rec(0, 1.0), _rec(1, 2.0), _rec(2, None)]
    again = [[_rec(0, 1.1), _rec(1, 2.0), _rec(2, 3.0)], [_rec(0, 0.5), _rec(1, 3.0)]]
    floor = validate.e2e_floor(first, again)
    # errors 10 %, 0 %, 50 %, 50 % (the unfinished request counts in neither run)
    assert floor["e2e_floor_runs"] == 2
    assert floor["e2e_floor_median_pct"] == pytest.approx(30.0)
    assert validate.e2e_floor(first, [])["e2e_floor_median_pct"] is None


def test_the_verdict_says_whether_a_real_run_is_any_closer() -> None:
    assert "machine's limit" in validate.e2e_verdict(8.0, 9.7)
    assert "misses" in validate.e2e_verdict(12.0, 9.7)
    # above the floor only by the speed level between the profile and the run
    assert "speed moved" in validate.e2e_verdict(21.2, 11.9, 9.3)
    assert "misses" in validate.e2e_verdict(21.2, 11.9, 14.0)
    assert "--floor-runs 0" in validate.e2e_verdict(8.0, None)
    few = validate.e2e_verdict(8.0, 9.7, compared=6)  # a 6-request run judged as a 100
    assert few.endswith("(over 6 requests only: rough; --requests 30 or more)")
    assert "requests only" not in validate.e2e_verdict(8.0, 9.7, compared=100)


def test_validate_runs_the_real_engine_again_for_the_floor(model: Any, tmp_path: Path) -> None:
    prof = tiny_engine_profile(model, tmp_path / "tiny.json")
    kw: dict[str, Any] = {
        "model": model, "profile": prof, "requests": 6, "kv_capacity": 10_000,
        "max_num_seqs": 8, "max_batch_tokens": 64,
    }  # fmt: skip
    fig = validate.run(jobs=_jobs(6), floor_runs=2, **kw)
    assert fig["e2e_floor_runs"] == 2
    assert fig["e2e_floor_median_pct"] is not None
    assert fig["e2e_floor_median_pct"] >= 0
    assert fig["e2e_floor_p90_pct"] >= fig["e2e_floor_median_pct"]
    # the profile at the run's own speed: the simulator again, its steps scaled to the run's
    assert fig["step_seconds_real_over_model"] > 0
    assert fig["e2e_at_run_speed_median_pct"] >= 0
    assert fig["e2e_at_run_speed_p90_pct"] >= fig["e2e_at_run_speed_median_pct"]
    none = validate.run(jobs=_jobs(6), floor_runs=0, samples=tmp_path / "steps.jsonl", **kw)
    assert none["e2e_floor_runs"] == 0
    assert none["e2e_floor_median_pct"] is None
    # the real run's steps, written as profile --samples writes its own
    steps = steps_from_telemetry(tmp_path / "steps.jsonl")
    assert len(steps) == none["real_steps"]
    assert {json.loads(line)["source"] for line in (tmp_path / "steps.jsonl").open()} == {
        "validate"
    }
    with pytest.raises(ValueError, match="--floor-runs"):
        validate.run(jobs=_jobs(6), floor_runs=-1, **kw)


def test_the_repeat_floor_is_the_spread_of_steps_of_one_shape() -> None:
    from duetime.predict.cost_report import MIN_REPEATS, repeat_floor_pct
    from duetime.predict.ete import StepSample

    def decode(seconds: float, kv: int) -> StepSample:
        return StepSample(0, 0.0, 2, kv, seconds, "decode")

    # one shape (2 decoders, KV within 16 a decoder) timed 0.9, 1.0, 1.0, 1.0, 1.1 s
    steps = [decode(t, 200 + k) for k, t in enumerate((0.9, 1.0, 1.0, 1.0, 1.1))]
    assert repeat_floor_pct(steps) == (pytest.approx(4.0), MIN_REPEATS)
    # another shape's few steps do not count, however they spread
    spread, counted = repeat_floor_pct([*steps, decode(5.0, 4000), decode(9.0, 4000)])
    assert (spread, counted) == (pytest.approx(4.0), MIN_REPEATS)
    assert repeat_floor_pct(steps[:-1]) == (None, 0)


def test_the_profile_verdict_takes_the_larger_floor() -> None:
    from duetime.predict.cost_report import profile_payload
    from duetime.predict.ete import StepSample, step_kind

    rng = random.Random(3)

    def step(p: int, d: int) -> StepSample:  # steps that spread 0-20 % around a line
        seconds = (1 + 0.2 * rng.random()) * (1e-3 + 1e-5 * p + 1e-4 * d)
        return StepSample(p, float(p * p), d, d * 64, seconds, step_kind(p, d))

    samples = [
        step(p, d) for p in (0, 8, 32, 128) for d in (0, 1, 4, 16) if p or d for _ in range(6)
    ]
    kw: dict[str, Any] = {
        "name": "t", "source": "t", "kv_capacity_tokens": 1, "max_num_seqs": 1,
        "max_batch_tokens": 1, "noise_floor_pct": 2.0,
    }  # fmt: skip
    quiet = profile_payload(samples, **kw)
    assert quiet["verdict_floor_pct"] == 2.0
    busy = profile_payload(samples, repeat_floor=30.0, **kw)
    assert busy["verdict_floor_pct"] == 30.0
    assert busy["at_noise_limit"] is True
    assert quiet["at_noise_limit"] is False


def test_the_speed_now_is_read_against_the_profiles_own_repeated_steps() -> None:
    from duetime.engine.profile import NoiseShape
    from duetime.predict.cost_report import speed_against_profile

    meta = {"noise": [{"name": "a", "median_s": 0.010}, {"name": "b", "median_s": 0.100}]}
    now = [NoiseShape("a", 0.012, 1.0), NoiseShape("b", 0.1 * 1.2**0.5, 1.0)]
    # the geometric mean of 1.2 and sqrt(1.2)
    assert speed_against_profile(meta, now) == pytest.approx(1.2**0.75)
    assert speed_against_profile(meta, [NoiseShape("c", 0.01, 1.0)]) is None
    assert speed_against_profile({}, now) is None  # a profile that timed no noise
    assert speed_against_profile({"noise": [{"name": "a", "median_s": 0}]}, now) is None
