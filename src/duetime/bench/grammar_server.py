"""Robot commands under a JSON schema, sent through the server under a deadline.

Part of ``duetime bench grammar``. :func:`run_admission` sends commands one
after another through a fresh in-process server an arm, judged by the steps the
grammar's answers take (``server/grammar_steps.py``) or by a step a token (what
admission assumes of a grammar it has not learned). :func:`run_bursts` has a
fleet send them together, round after round, to see how a burst's forecasts
count its companions (``server/recent_load.py``).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from duetime.core.grammar import AnswerWork, GrammarSpec
from duetime.core.request import LengthPrediction
from duetime.server.grammar_steps import GrammarSteps

__all__ = ["BURST_PERIOD_S", "COMMAND", "COMMAND_PROMPTS", "run_admission", "run_bursts"]


#: A robot's command as OpenAI's SDK sends a pydantic model (strict): most of its text is
#: keys and punctuation the grammar forces, a few tokens are the model's choices.
COMMAND = {
    "type": "object",
    "properties": {
        "action": {"enum": ["move", "grasp", "release", "stop"]},
        "target": {"enum": ["cup", "plate", "bottle", "door"]},
        "speed": {"enum": ["slow", "normal", "fast"]},
        "confirm_before_acting": {"type": "boolean"},
    },
    "required": ["action", "target", "speed", "confirm_before_acting"],
    "additionalProperties": False,
}


#: What a robot's client asks under :data:`COMMAND` (:func:`run_admission`).
COMMAND_PROMPTS = (
    "Pick up the cup now.",
    "Open the door slowly.",
    "Stop!",
    "Grab the bottle fast, then stop.",
    "Put the plate down.",
)


def run_admission(
    make_state: Callable[[], Any],
    model_name: str,
    *,
    requests: int = 10,
    deadline_ms: float = 500.0,
    learn: bool = True,
) -> dict[str, Any]:
    """``requests`` robot commands under ``deadline_ms``, one after another, through a
    fresh server from ``make_state`` (no answer under the schema before them): judged
    by the steps the grammar's answers take (``learn``) or by a step a token. How many
    were accepted and met, and each accepted one's forecast and actual end-to-end."""
    state = make_state()
    if not learn:
        state.grammar_steps = _StepPerToken()
    forecast, actual, refused = [], [], 0
    met = 0
    with _client(state) as client:
        _warm_up(client, model_name)
        for i in range(requests):
            timing = _command(client, model_name, i, deadline_ms)
            if timing is None:
                refused += 1
                continue
            met += bool(timing["deadline_met"])
            forecast.append(timing.get("predicted_e2e_ms"))
            actual.append(timing["e2e_ms"])
    ratios = [f / a for f, a in zip(forecast, actual, strict=True) if f is not None and a > 0]
    return {
        "requests": requests,
        "deadline_ms": deadline_ms,
        "accepted": requests - refused,
        "met": met,
        "forecast_e2e_ms": forecast,
        "e2e_ms": actual,
        # how far the forecasts were from the answers' end (1: on time; the forced rows
        # riding in a structured answer's steps are what a step a row misses)
        "forecast_to_actual_e2e_median": statistics.median(ratios) if ratios else None,
    }


#: How `run_bursts` sends its fleet's commands: seconds between the rounds' starts.
BURST_PERIOD_S = 2.0


def run_bursts(
    make_state: Callable[[], Any],
    model_name: str,
    *,
    size: int = 6,
    rounds: int = 5,
    period_s: float = BURST_PERIOD_S,
    deadline_ms: float = 5000.0,
) -> dict[str, Any]:
    """A fleet of ``size`` robots, each sending a command under ``deadline_ms`` at the
    start of every round, ``period_s`` apart (open loop: a round starts on time whether
    or not the last is answered), through a fresh server from ``make_state`` that has
    learned the schema from three commands sent alone. How many were accepted and met;
    each accepted command's forecast and end-to-end; per round the smallest forecast's
    ratio to its e2e (the first judged, before the others) and the largest's."""
    from concurrent.futures import ThreadPoolExecutor

    state = make_state()
    timings: list[list[dict[str, Any] | None]] = []
    with _client(state) as client, ThreadPoolExecutor(size) as pool:
        _warm_up(client, model_name)
        for i in range(3):
            _command(client, model_name, i, deadline_ms)
        start = time.perf_counter()
        for r in range(rounds):
            time.sleep(max(0.0, start + r * period_s - time.perf_counter()))
            sent = [pool.submit(_command, client, model_name, i, deadline_ms) for i in range(size)]
            timings.append([f.result() for f in sent])
    return _burst_figures(timings, size, period_s, deadline_ms)


def _burst_figures(
    rounds: list[list[dict[str, Any] | None]], size: int, period_s: float, deadline_ms: float
) -> dict[str, Any]:
    """What the rounds' commands' timings (None: refused) come to."""
    smallest, largest, every = [], [], []
    for timings in rounds:
        seen = sorted(
            (t["predicted_e2e_ms"], t["e2e_ms"])
            for t in timings
            if t is not None and t.get("predicted_e2e_ms") and t["e2e_ms"] > 0
        )
        if seen:
            smallest.append(seen[0][0] / seen[0][1])
            largest.append(seen[-1][0] / seen[-1][1])
            every += [f / a for f, a in seen]
    accepted = [t for timings in rounds for t in timings if t is not None]
    met = sum(bool(t["deadline_met"]) for t in accepted)
    return {
        "size": size,
        "rounds": len(rounds),
        "period_s": period_s,
        "deadline_ms": deadline_ms,
        "accepted": len(accepted),
        "met": met,
        "hit_rate_of_accepted": met / len(accepted) if accepted else None,
        "accepted_per_round": [sum(t is not None for t in timings) for timings in rounds],
        "forecast_e2e_ms": [[t and t.get("predicted_e2e_ms") for t in ts] for ts in rounds],
        "e2e_ms": [[t and t["e2e_ms"] for t in ts] for ts in rounds],
        "smallest_forecast_to_e2e": smallest,
        "largest_forecast_to_e2e": largest,
        "forecast_to_e2e_median": statistics.median(every) if every else None,
    }


class _StepPerToken(GrammarSteps):
    """What admission assumed before it learned a grammar's work: a step a token, and
    the predictor's length capped at the grammar's bound."""

    def most(self, spec: GrammarSpec) -> AnswerWork | None:
        return None

    def lengths(self, spec: GrammarSpec, most: int) -> LengthPrediction | None:
        return None


def _client(state: Any) -> Any:
    from fastapi.testclient import TestClient

    from duetime.server.app import create_app

    return TestClient(create_app(state))


def _warm_up(client: Any, model_name: str) -> None:
    """The engine and its step-time fit warm up on free text, as a server that has run."""
    for _ in range(3):
        client.post(
            "/v1/completions", json={"model": model_name, "prompt": "Hello.", "max_tokens": 32}
        )


_COMMAND_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "cmd", "schema": COMMAND, "strict": True},
}


def _command(client: Any, model_name: str, i: int, deadline_ms: float) -> dict[str, Any] | None:
    """Command ``i`` (of :data:`COMMAND_PROMPTS`, in turn) under ``deadline_ms``: the
    answer's ``duetime`` timing, or None where it was refused (429)."""
    body = {
        "model": model_name,
        "messages": [{"role": "user", "content": COMMAND_PROMPTS[i % len(COMMAND_PROMPTS)]}],
        "max_tokens": 128,
        "response_format": _COMMAND_FORMAT,
        "deadline_ms": deadline_ms,
    }
    r = client.post("/v1/chat/completions", json=body)
    if r.status_code == 429:
        return None
    if r.status_code != 200:
        raise RuntimeError(f"the server answered {r.status_code}: {r.text[:200]}")
    timing: dict[str, Any] = r.json()["duetime"]
    return timing
