"""Assemble a server: model + codec + policy + engine thread + admission, from plain options.

``model="gemma"`` serves the packaged Gemma 3 270M; ``model="tiny"`` serves a
small random-weight Gemma 3 with a byte tokenizer (tests, and trying the API
in a second without loading weights); any other value is a GGUF path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from duetime.core.cost import LinearStepCost
from duetime.engine.cost_regimes import regimes_of_any
from duetime.engine.eviction import EVICTION_METHODS
from duetime.engine.executor import EngineExecutor
from duetime.engine.gemma3 import Gemma3
from duetime.policies.registry import make_policy
from duetime.predict.cost_report import engine_of
from duetime.predict.oracle import JobPredictor, make_job_predictor
from duetime.predict.served_lengths import ServedLengths
from duetime.server.admission import ADMISSION_MODES, Admission
from duetime.server.codec import ByteCodec, Codec, GemmaCodec
from duetime.server.engine_loop import EngineLoop
from duetime.server.forecast_errors import ForecastErrors, check_confidence
from duetime.server.recent_load import DEFAULT_BURST_GAP_S
from duetime.server.step_timer import StepTimer

__all__ = [
    "DEFAULT_CONFIDENCE",
    "ServeOptions",
    "build_state",
    "check_options",
    "load_served_model",
    "served_executor",
]

#: The share of accepted requests with a deadline that should meet it (docs/server-admission.md:
#: 0.976 met at 0.95 in `duetime bench admission`'s default load, against 0.902 without).
DEFAULT_CONFIDENCE = 0.95
#: Seconds at least between two refits of the online step-time fit: a fit is 12-46 ms
#: of one core (server/step_timer.py), so at most ~2 % of it.
ONLINE_FIT_INTERVAL_S = 2.0


def served_context(kv_capacity: int, max_position: int | None = None) -> int:
    """Tokens a request's prompt and answer may take together on a server of
    ``kv_capacity`` KV tokens: one short of it (a sequence's next token needs a slot),
    and no more than the model's ``max_position`` where that is known."""
    room = kv_capacity - 1
    return room if max_position is None else min(max_position, room)


def served_policy(options: ServeOptions) -> Any:
    """A fresh instance of the served policy with its arguments: the executor's, each
    forecast's where there is no fork to run, and the options check's."""
    return make_policy(options.policy, **dict(options.policy_kwargs or {}))


@dataclass(slots=True)
class ServeOptions:
    """What `duetime serve` runs: its options, and the limits auto sizing chose."""

    model: str = "gemma"
    served_model_name: str | None = None
    policy: str = "edf"
    policy_kwargs: dict[str, Any] | None = None
    dtype: str = "fp32"
    kv_capacity: int = 32_768
    max_num_seqs: int = 32
    max_batch_tokens: int = 2048
    max_waiting: int = 256
    admission: str = "forecast"  # how deadlines are judged: forecast or estimate
    prefix_cache_tokens: int = 4096  # automatic prefix caching's budget; 0: off
    predictor: str | None = "auto"  # auto: the learned length predictor for real models
    # the predictor is corrected by the newest this many answers of the served model; 0: off
    length_window: int = 1000
    # forecast admission: accept a request only if its forecast, stretched by the recent
    # forecasts' errors at this quantile, meets the deadline (a target hit rate); None:
    # the plain forecast. The estimate has none.
    deadline_confidence: float | None = DEFAULT_CONFIDENCE
    # forecast admission: arrivals this close make a burst, whose companions the first
    # of one is forecast with (0: none; server/recent_load.py)
    burst_gap_s: float = DEFAULT_BURST_GAP_S
    profile: Path | None = None
    telemetry: Path | None = None
    seed: int = 0
    eviction: str = "snapkv"  # how KV is dropped when the policy evicts: snapkv or streaming
    stall_after_s: float = 30.0  # /health is 503 once a step has run this long
    request_timeout_s: float = 600.0  # an answer not done by then: 504, its sequence aborted
    #: How the batch limits were chosen (server/autosize.py), shown in /health and
    #: /v1/models; None: as given.
    limits: dict[str, Any] | None = None
    #: The model's steps timed at start (server/autosize.py): the online step-time fit's
    #: prior, until the served steps replace it. None: nothing is judged before them.
    measured_cost: LinearStepCost | None = None


def load_served_model(options: ServeOptions) -> tuple[Gemma3, Codec, str]:
    """The model, its codec and the name clients must send."""
    if options.model == "tiny":
        from duetime.engine.testing import engine_from_hf, tiny_hf_model

        hf = tiny_hf_model(seed=options.seed, vocab_size=ByteCodec.vocab_size)
        return engine_from_hf(hf), ByteCodec(), options.served_model_name or "duetime-tiny"
    from duetime.engine.load import load_model

    path = None if options.model == "gemma" else options.model
    model = load_model(path, dtype=options.dtype)  # type: ignore[arg-type]
    name = options.served_model_name or ("gemma-3-270m" if path is None else Path(path).stem)
    return model, GemmaCodec(), name


def build_state(options: ServeOptions, model: Gemma3, codec: Codec, name: str) -> Any:
    """A :class:`~duetime.server.server_state.ServerState` with its engine loop (not
    started yet)."""
    from duetime.server.server_state import ServerConfig, ServerState

    cost = LinearStepCost.from_profile(options.profile) if options.profile else None
    # a profile fixes the cost model; the model's steps timed at start only seed the
    # online fit, so that admission judges the first requests too
    if cost is not None:
        prior_source = f"given profile {options.profile}"
    elif options.measured_cost is not None:
        prior_source = "measured at start"
    else:
        prior_source = "given"
    timer = StepTimer(
        prior=cost or options.measured_cost,
        prior_source=prior_source,
        regimes=regimes_of_any(model),
        min_interval_s=ONLINE_FIT_INTERVAL_S,
        background=True,
    )
    policy = _checked_settings(options)
    confidence = options.deadline_confidence
    forecasts = options.admission == "forecast"
    errors = ForecastErrors(confidence) if forecasts and confidence is not None else None

    predictor = _predictor(options)
    _check_predicted(policy, options, predictor)
    served = None
    if predictor is not None and options.length_window:
        served = ServedLengths(window=options.length_window)
    # the image: what a forecast forks from, and how far the running answers are
    images = forecasts or served is not None

    def make_executor() -> EngineExecutor:
        return served_executor(options, model, codec, cost=cost)

    engine = EngineLoop(make_executor, timer=timer, fixed_cost=cost is not None, images=images)
    warm_up = getattr(predictor, "warm_up", None)
    if warm_up is not None:
        warm_up()  # load the encoder before the server reports healthy, not on request one
    cfg = ServerConfig(
        model_name=name,
        max_context=served_context(options.kv_capacity, model.config.max_position_embeddings),
        vocab_size=model.config.vocab_size,
        stall_after_s=options.stall_after_s,
        request_timeout_s=options.request_timeout_s,
        limits=options.limits
        or {"max_num_seqs": options.max_num_seqs, "max_batch_tokens": options.max_batch_tokens},
        # the tiny model is built in float32 whatever the dtype asked
        engine=engine_of(
            "fp32" if options.model == "tiny" else options.dtype, torch.get_num_threads()
        ),
    )
    return ServerState(
        config=cfg,
        engine=engine,
        codec=codec,
        admission=Admission(
            timer,
            max_waiting=options.max_waiting,
            policy=(lambda: served_policy(options)) if forecasts else None,
            errors=errors,
            burst_gap_s=options.burst_gap_s,
        ),
        predictor=predictor,
        served_lengths=served,
    )


def served_executor(
    options: ServeOptions,
    model: Gemma3,
    codec: Codec,
    *,
    cost: LinearStepCost | None = None,
    telemetry: Path | None = None,
) -> EngineExecutor:
    """The executor the server steps (a fresh one after a failed step), and the one
    `bench serve-load` replays offline: ``cost`` a profile's fixed model, else the one
    timed at start (:attr:`ServeOptions.measured_cost`); ``telemetry`` overrides the
    options' step log."""
    ex = EngineExecutor(
        served_policy(options),
        model,
        kv_capacity=options.kv_capacity,
        max_num_seqs=options.max_num_seqs,
        max_batch_tokens=options.max_batch_tokens,
        cost=cost or options.measured_cost,
        telemetry=telemetry or options.telemetry,
        check_accounting=False,
        eviction=options.eviction,
        prefix_cache_tokens=options.prefix_cache_tokens,
    )
    ex.eos_token_id = codec.eos_id
    return ex


def check_options(options: ServeOptions) -> None:
    """Refuse what :func:`build_state` would refuse, without the model: `duetime serve`
    calls it before the minutes of loading and timing the model, where a bad
    ``--admission`` or ``--predictor`` was refused only after them."""
    policy = _checked_settings(options)
    if _predictor_spec(options) is None:
        _check_predicted(policy, options, None)


def _check_predicted(policy: Any, options: ServeOptions, predictor: JobPredictor | None) -> None:
    if predictor is None and getattr(policy, "needs_prediction", False):
        raise ValueError(
            f"policy {options.policy!r} orders requests by their predicted length and "
            "cannot run without a predictor; serve it with --predictor learned[:<path>]"
        )


def _checked_settings(options: ServeOptions) -> Any:
    """The options' policy, once every setting but the predictor is checked."""
    policy = served_policy(options)
    if options.admission not in ADMISSION_MODES:
        raise ValueError(
            f"admission must be one of {', '.join(ADMISSION_MODES)}, not {options.admission!r}"
        )
    if options.eviction not in EVICTION_METHODS:
        raise ValueError(
            f"eviction must be one of {', '.join(EVICTION_METHODS)}, not {options.eviction!r}"
        )
    if not options.burst_gap_s >= 0:
        raise ValueError(f"burst_gap_s must be >= 0, got {options.burst_gap_s}")
    if options.length_window < 0:
        raise ValueError(f"length_window must be >= 0, got {options.length_window}")
    if options.deadline_confidence is not None:  # checked in every mode, used by forecasts
        check_confidence(options.deadline_confidence)
    return policy


def _predictor_spec(options: ServeOptions) -> str | None:
    """The length predictor the server builds (None: none), checked by name alone: a
    learned model is read only when the server is built."""
    from duetime.predict.length_fit import SHIPPED_MODELS

    spec = options.predictor
    if spec == "auto":
        spec = None if options.model == "tiny" else "learned"
    if spec is None or spec == "none":
        return None
    if spec in ("oracle",) or spec.startswith(("noisy", "interval")):
        raise ValueError(
            f"predictor {spec!r} needs the true answer length, which a server never has; "
            "use 'learned', 'learned:<path>' or 'none'"
        )
    kind, _, arg = spec.partition(":")
    if kind != "learned":
        raise ValueError(
            f"unknown predictor {spec!r}; use auto, none, learned, learned:<shipped model> "
            f"({', '.join(SHIPPED_MODELS)}) or learned:<path>"
        )
    if arg and arg not in SHIPPED_MODELS and not Path(arg).is_file():
        raise ValueError(
            f"predictor {spec!r}: {arg} is neither a file nor a shipped model "
            f"({', '.join(SHIPPED_MODELS)})"
        )
    return spec


def _predictor(options: ServeOptions) -> JobPredictor | None:
    return make_job_predictor(_predictor_spec(options))
