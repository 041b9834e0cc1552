"""What the server's handlers share: its configuration and its state (the engine loop,
codec, admission, predictor, metrics and the grammars' books)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from duetime.core.grammar import GrammarSpec
from duetime.core.request import Job, LengthPrediction
from duetime.engine.grammar import GrammarCompiler
from duetime.engine.openmp_workers import compute_on_one_thread
from duetime.predict.oracle import JobPredictor
from duetime.predict.served_lengths import ServedLengths
from duetime.server.admission import Admission
from duetime.server.codec import Codec
from duetime.server.engine_loop import EngineLoop
from duetime.server.grammar_steps import GrammarSteps
from duetime.server.metrics import ServerMetrics
from duetime.server.predict_batcher import PredictBatcher
from duetime.server.streams import Outcome

__all__ = ["ServerConfig", "ServerState"]


@dataclass(slots=True)
class ServerConfig:
    model_name: str
    max_context: int  # prompt + max_tokens may not exceed this
    vocab_size: int
    #: A chat request without max_tokens gets this many, or what the context has left.
    default_chat_max_tokens: int = 256
    max_body_bytes: int = 1 << 20
    body_timeout_s: float = 30.0  # a request body not complete by then: 408
    request_timeout_s: float = 600.0
    #: /health answers 503 once the engine has held work this long without finishing a
    #: step (a hung engine: the gateway's probe then routes around it).
    stall_after_s: float = 30.0
    #: The engine's batch limits and how they were chosen (shown in /health, /v1/models).
    limits: dict[str, Any] | None = None
    #: The engine the steps run on, as a profile records it (``{"dtype", "threads"}``):
    #: /v1/profile carries it, so that a saved copy is refused by another engine.
    engine: dict[str, Any] | None = None


@dataclass(slots=True)
class ServerState:
    """Everything the handlers share."""

    config: ServerConfig
    engine: EngineLoop
    codec: Codec
    admission: Admission
    predictor: JobPredictor | None = None
    #: The served model's finished answers, which correct the predictor's points (None: off).
    served_lengths: ServedLengths | None = None
    metrics: ServerMetrics = field(init=False)
    created: int = field(default_factory=lambda: int(time.time()))
    #: The predictor runs here (its tokenizer is not safe to share between threads), off
    #: the event loop, on the requests waiting for it together (``predict_batcher``), on
    #: one torch thread: the engine's thread alone has OpenMP workers (openmp_workers.py).
    predict_pool: ThreadPoolExecutor = field(
        init=False,
        default_factory=lambda: ThreadPoolExecutor(
            1, "duetime-predict", initializer=compute_on_one_thread
        ),
    )
    predict_batcher: PredictBatcher = field(init=False)
    #: Structured outputs' grammars over the codec's vocabulary (compiled ones are kept).
    grammars: GrammarCompiler = field(init=False)
    #: The work (steps, riding rows) each grammar's answers took (jump-forward): what
    #: admission assumes.
    grammar_steps: GrammarSteps = field(init=False, default_factory=GrammarSteps)
    #: Sequences of requests that have arrived (their time taken) and are on their way
    #: to admission (their lengths being predicted): a burst's companions, which a
    #: forecast of the first of them expects beside it.
    arriving: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        # Outcomes are counted by each request's Stream, as its client saw them.
        served = self.served_lengths
        self.metrics = ServerMetrics(
            lambda: self.engine.stats, (lambda: None) if served is None else served.summary
        )
        self.predict_batcher = PredictBatcher(self._predict_many, self.predict_pool)
        self.grammars = GrammarCompiler(lambda: self.codec.guidance_tokenizer())

    def counter(
        self,
        rid: int | None,
        grammar: GrammarSpec | None = None,
        answered: GrammarSpec | None = None,
    ) -> Callable[[Outcome], None]:
        """What hears a request's outcome: the metrics; the served-length window, for
        ``rid`` (a request whose answer it follows); the work its ``grammar``'s answers
        take (a request whose forced runs may jump); the lengths of the answers under
        ``answered``, its grammar however its tokens come; admission's record of its
        forecasts' errors, where it keeps one (``--deadline-confidence``)."""
        served = self.served_lengths
        errors = self.admission.errors
        watching = grammar is not None or answered is not None
        if (rid is None or served is None) and errors is None and not watching:
            return self.metrics.observe

        def count(outcome: Outcome) -> None:
            self.metrics.observe(outcome)
            if rid is not None and served is not None:
                served.end(rid, outcome.output_tokens, outcome.finish_reason)
            done = outcome.finish_reason in ("stop", "length")
            if answered is not None and outcome.finish_reason == "stop":
                self.grammar_steps.answered(answered, outcome.output_tokens)
            if grammar is not None and done:
                self.grammar_steps.observe(
                    grammar, outcome.output_tokens, outcome.jumped_tokens, outcome.rode_tokens
                )
            forecast = outcome.forecast_e2e
            if errors is not None and done and forecast is not None and outcome.deadline:
                errors.observe(forecast, outcome.e2e, outcome.deadline - outcome.arrival)

        return count

    def _predict_many(self, jobs: Sequence[Job]) -> list[LengthPrediction | None]:
        """Predictions for ``jobs`` (on the predictor's thread): one batch where the
        predictor takes one. The caller caps each at what its request may answer."""
        predictor = self.predictor
        if predictor is None:
            return [None] * len(jobs)
        many = getattr(predictor, "predict_requests", None)
        if many is not None:
            return list(many([j.request for j in jobs]))
        return [predictor.predict_job(j) for j in jobs]
