"""The server's online step-time fit (server/step_timer.py): when it refits, and that
the server's fits run beside the engine thread, not on it."""

from __future__ import annotations

import threading

import pytest

from duetime.core.cost import LinearStepCost
from duetime.server.step_timer import StepTimer

TRUE = LinearStepCost.batch(c=0.010, a=0.0005, b=0.002, d=1e-6)


def _feed(timer: StepTimer, n: int, start: int = 0) -> list[bool]:
    """``n`` decode and prefill steps timed by ``TRUE``; what each observe() returned."""
    out = []
    for i in range(start, start + n):
        p, d = (64 * (1 + i % 4), 0) if i % 5 == 0 else (0, 1 + i % 12)
        kv = 100 * d
        out.append(timer.observe(TRUE.step_time(p, float(p * p), d, kv), p, d, kv, p * p))
    return out


def test_a_foreground_timer_fits_inside_observe_every_refit_steps() -> None:
    timer = StepTimer(min_steps=16, refit_every=32)
    fits = _feed(timer, 80)
    assert [i for i, f in enumerate(fits) if f] == [15, 47, 79]  # min_steps in, then every 32
    cost = timer.as_cost()
    assert cost is not None
    assert cost.step_time(0, 0.0, 8, 800) == pytest.approx(TRUE.step_time(0, 0.0, 8, 800), rel=0.02)


def test_the_servers_timer_fits_on_its_own_thread_and_reports_the_model_once() -> None:
    timer = StepTimer(min_steps=16, refit_every=32, background=True)
    try:
        assert not any(_feed(timer, 16))  # the fit was asked for, not run here
        assert timer.wait_idle()
        fitter = [t for t in threading.enumerate() if t.name == "duetime-step-fit"]
        assert fitter
        assert fitter[0] is not threading.current_thread()
        assert timer.as_cost() is not None
        assert timer.origin() == ("online fit", 16)
        assert _feed(timer, 2, start=16) == [True, False]  # the new model, reported once
    finally:
        timer.close()
    assert not any(t.name == "duetime-step-fit" and t.is_alive() for t in threading.enumerate())


def test_closing_with_a_fit_asked_for_leaves_no_fit_to_wait_for() -> None:
    """The server shuts down right after a fit was asked for: the fit is dropped or
    finished, and waiting for the fitter returns at once instead of timing out."""
    for _ in range(20):  # the fitter may or may not have taken the rows before close()
        timer = StepTimer(min_steps=16, refit_every=32, background=True)
        _feed(timer, 16)
        timer.close()
        assert timer.wait_idle(timeout_s=2.0)


def test_fits_wait_at_least_the_interval() -> None:
    timer = StepTimer(min_steps=16, refit_every=8, min_interval_s=3600.0)
    fits = _feed(timer, 100)
    assert sum(fits) == 1  # the first fit only: the next is due an hour later


def test_a_failed_background_fit_keeps_the_last_model(monkeypatch) -> None:
    import duetime.server.step_timer as st

    def broken(*_args, **_kwargs):
        raise ValueError("singular")

    monkeypatch.setattr(st, "fit_batch_cost", broken)
    timer = StepTimer(prior=TRUE, prior_source="measured at start", background=True)
    try:
        _feed(timer, 40)
        assert timer.wait_idle()
        assert timer.as_cost() is TRUE
        assert timer.origin() == ("measured at start", 0)
    finally:
        timer.close()


def test_the_server_fits_the_round_each_step_took_not_its_forward_pass() -> None:
    """What the engine loop hands its timer: each served round (admission, scheduling,
    the forward pass, handing out tokens), so never less than the step's forward time."""
    import httpx

    from duetime.server.app import create_app
    from duetime.server.build import ServeOptions, build_state, load_served_model
    from duetime.server.threaded import serve_in_thread

    options = ServeOptions(model="tiny", predictor=None)
    state = build_state(options, *load_served_model(options))
    loop = state.engine
    seen: list[tuple[float, float]] = []  # (what the timer got, the step's forward time)
    observe = loop.timer.observe

    def spy(seconds: float, *shape: float) -> bool:
        seen.append((seconds, loop.executor.last_step[0]))
        return observe(seconds, *shape)  # type: ignore[arg-type]

    loop.timer.observe = spy  # type: ignore[method-assign]
    body = {"model": "duetime-tiny", "prompt": "Hello there", "max_tokens": 8}
    with serve_in_thread(create_app(state)) as url:
        for _ in range(3):
            assert httpx.post(url + "/v1/completions", json=body, timeout=60).status_code == 200
    assert len(seen) >= 8
    assert all(got >= forward > 0 for got, forward in seen)
    assert any(got > forward for got, forward in seen)


def _one_decoder_window(timer: StepTimer, truth: LinearStepCost, n: int = 64) -> None:
    for i in range(n):
        kv = 100 + i
        timer.observe(truth.step_time(0, 0.0, 1, kv), 0, 1, kv, 0.0)


def test_shapes_the_window_never_saw_are_priced_by_the_prior_at_todays_speed() -> None:
    """A window of one-sequence decodes says nothing about prompts: the fit prices them
    as the prior does, scaled by how much slower the window's steps ran than it said."""
    from duetime.core.cost_bands import CostRegimes

    regimes = CostRegimes(rows=(8,), head_rows=(2, 4))
    slower = LinearStepCost.batch(c=0.012, a=0.0006, b=0.0024, d=1.2e-6)  # TRUE x 1.2
    anchored = StepTimer(prior=TRUE, regimes=regimes, min_steps=64, refit_every=64)
    bare = StepTimer(regimes=regimes, min_steps=64, refit_every=64)
    for timer in (anchored, bare):
        _one_decoder_window(timer, slower)
    fitted, unanchored = anchored.as_cost(), bare.as_cost()
    assert fitted is not None
    assert unanchored is not None
    assert fitted.decode_step(1, 130) == pytest.approx(slower.decode_step(1, 130), rel=0.02)
    for p, d in ((256, 0), (64, 8), (0, 32)):
        want = slower.step_time(p, float(p * p), d, 256 * d)
        assert fitted.step_time(p, float(p * p), d, 256 * d) == pytest.approx(want, rel=0.1)
    prompt = unanchored.step_time(256, 256.0 * 256, 0, 0)
    assert prompt != pytest.approx(slower.step_time(256, 256.0 * 256, 0, 0), rel=0.1)
