"""What the admission-by-forecast tests share: a step cost, engine images and jobs.

A step cost of 50 ms whatever the step holds (``STEP_S``, ``COST``); an engine image
with one request decoding (:func:`busy_image`); a job asking for a few tokens within
2 s (:func:`ask_job`); an admission judging by forecast or by estimate
(:func:`make_admission`); and a tiny-model server state whose prior is 50 ms a step
(:func:`slow_server`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from duetime.core.cost import LinearStepCost
from duetime.core.image import EngineImage
from duetime.core.request import Job, LengthPrediction, Request
from duetime.policies.registry import make_policy
from duetime.server.admission import Admission
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.engine_loop import EngineStats
from duetime.server.step_timer import StepTimer
from duetime.sim.simulator import SimConfig, Simulator

STEP_S = 0.05  # every step 50 ms, whatever it holds
COST = LinearStepCost.batch(c=STEP_S, a=0.0, b=0.0, d=0.0)


def busy_image(max_num_seqs: int = 1) -> tuple[EngineImage, EngineStats]:
    """One request decoding, 90 of its 100 tokens to go (4.5 s), in a batch of one."""
    sim = Simulator(make_policy("edf"), COST, SimConfig(max_num_seqs=max_num_seqs, max_time=0.5))
    busy = Request(rid=1, arrival=0.0, prompt_len=16, max_tokens=100)
    busy.predicted = LengthPrediction.exact(100)
    sim.run([Job(busy, output_len=100)])
    image = sim.image()
    assert [s.generated for s in image.seqs] == [10]
    stats = EngineStats(now=image.now, running=1, kv_used=25, kv_capacity=sim.kv_capacity)
    return image, stats


def ask_job(rid: int, tokens: int, now: float) -> Job:
    req = Request(rid=rid, arrival=now, prompt_len=8, max_tokens=tokens, deadline=now + 2.0)
    req.predicted = LengthPrediction.exact(tokens)
    return Job(req, output_len=tokens)


def make_admission(forecast: bool) -> Admission:
    timer = StepTimer(prior=COST)
    return Admission(timer, policy=(lambda: make_policy("edf")) if forecast else None)


def slow_server(tmp_path: Path, **options: Any) -> tuple[Any, Any, str]:
    """A tiny-model server state whose step-cost prior is 50 ms a step (with the model,
    to slow down, and the name clients send)."""
    profile = tmp_path / "slow.json"
    profile.write_text(json.dumps({"name": "slow", "coefficients": {"c0": STEP_S}}))
    opts = ServeOptions(model="tiny", predictor=None, kv_capacity=4096, profile=profile, **options)
    model, codec, name = load_served_model(opts)
    return build_state(opts, model, codec, name), model, name
