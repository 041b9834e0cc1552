"""The engine executor's state: what a real engine keeps beside the core's books (token
ids, KV slots, the wall clock, the per-request samplers, grammars, logs and stop
rules), its telemetry, and its end (spooled KV removed, telemetry closed)."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from duetime.core.cost import LinearStepCost
from duetime.core.executor import ExecutorCore
from duetime.core.policy import Policy
from duetime.engine.cost_regimes import attention_shape_of_any
from duetime.engine.eviction import DEFAULT_WINDOW, EVICTION_METHODS
from duetime.engine.gemma3 import Gemma3
from duetime.engine.logprobs import LogprobLog
from duetime.engine.sampling import Sampler
from duetime.engine.segment_stop import TextSegmenter

if TYPE_CHECKING:
    from duetime.engine.grammar import TokenGrammar


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: Most tokens a grammar may allow next for its row to take their logits from a gather
#: of their output rows instead of the whole vocabulary's product (4,096 rows of
#: Gemma's 640 are 10 MB of fp32, against 168 MB for the int8 ranking).
GRAMMAR_GATHER_MAX = 4096


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


@dataclass(frozen=True, slots=True)
class StopRule:
    """Token ids that end a request's answer once it holds ``min_tokens`` tokens: its
    end-of-sequence (unless it ignores it) and any a client named (vLLM's
    ``stop_token_ids``). The ending token is part of the answer."""

    ids: frozenset[int]
    min_tokens: int = 0

    def ends(self, token: int, generated: int) -> bool:
        """Whether ``token``, the ``generated``-th of the answer, ends it."""
        return token in self.ids and generated >= self.min_tokens


class EngineState(ExecutorCore):
    """The state of :class:`~duetime.engine.executor.EngineExecutor` (its parameters are
    documented there), its clock and telemetry."""

    def __init__(
        self,
        policy: Policy,
        model: Gemma3,
        *,
        kv_capacity: int = 32_768,
        max_num_seqs: int = 64,
        max_batch_tokens: int = 2048,
        predictor: Any = None,
        cost: LinearStepCost | None = None,
        telemetry: str | Path | None = None,
        check_accounting: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        offload_suspended: bool = False,
        eviction: str = "snapkv",
        snapkv_window: int = DEFAULT_WINDOW,
        skip_idle: bool = False,
        prefix_cache_tokens: int = 0,
        share_prefills: bool = True,
        grammar_gather_max: int = GRAMMAR_GATHER_MAX,
    ) -> None:
        if eviction not in EVICTION_METHODS:
            raise ValueError(
                f"eviction must be one of {', '.join(EVICTION_METHODS)}, not {eviction!r}"
            )
        if snapkv_window < 1:
            raise ValueError(f"snapkv_window must be >= 1, got {snapkv_window}")
        super().__init__(
            policy,
            kv_capacity=kv_capacity,
            max_num_seqs=max_num_seqs,
            max_batch_tokens=max_batch_tokens,
            predictor=predictor,
            offload_suspended=offload_suspended,
            prefix_cache_tokens=prefix_cache_tokens,
            # SnapKV scores the prompt's keys by its last queries: a hit leaves them
            prefix_compute_tail=snapkv_window if eviction == "snapkv" else 1,
            share_prefills=share_prefills,
        )
        self.model = model
        # how the model's kernels price a prompt chunk's attention (telemetry's A term)
        self.attention = attention_shape_of_any(model)
        self.kv = model.new_kv_cache()
        if self.prefix_cache is not None:
            # a block that began in an earlier step is still held when it is offered
            self.kv.keep_extra = self.prefix_cache.block_size - 1
        self.eviction = eviction
        self.snapkv_window = snapkv_window
        self.cost = cost
        self.check_accounting = check_accounting
        self._clock = clock
        self._t0 = clock()
        self.skip_idle = skip_idle
        self.idle_skipped_s = 0.0
        self.tokens: dict[int, list[int]] = {}  # prompt ids + generated ids
        # A restarted answer, to be made again token for token (see _on_restart).
        self._replay: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}
        self._telemetry_path = Path(telemetry) if telemetry is not None else None
        self._telemetry: IO[str] | None = None
        self._spool: Path | None = None  # where swapped-out KV waits (created on first use)
        self._spooled: dict[int, Path] = {}
        # Online serving: requests that end at end-of-sequence, and who hears each new token.
        self.eos_token_id: int | None = model.config.eos_token_id
        # rid → the tokens that end its answer (EOS, a client's stop ids), from min_tokens on
        self.stop_tokens: dict[int, StopRule] = {}
        self.last_step: tuple[float, int, int, int, float] | None = None  # (s, P, D, KV, attn)
        self.on_tokens: Callable[[list[tuple[int, int]]], None] | None = None
        # Segmented generation by text (TimelyLLM's stop checker): rid → its checker.
        self.segmenters: dict[int, TextSegmenter] = {}
        # Requests that sample instead of taking the arg-max: rid → its seeded sampler.
        self.samplers: dict[int, Sampler] = {}
        # Requests that asked for their tokens' log-probabilities: rid → where they go.
        self.logprob_logs: dict[int, LogprobLog] = {}
        # Structured outputs: rid → the grammar its answer's tokens are masked to.
        self.grammars: dict[int, TokenGrammar] = {}
        # a grammar row allowing at most this many next tokens gets only their logits
        # (0: every grammar row gets the whole vocabulary's, masked)
        self.grammar_gather_max = grammar_gather_max
        # rid → tokens its grammar forces next (already past the grammar), not yet in the
        # answer: they come before any other, and ride along in one chunk where room allows.
        self._forced: dict[int, list[int]] = {}
        self.jump_forward = True  # False: forced tokens one a step, as chosen ones
        # rid → forced tokens its answer took without a step of their own (jumped), so a
        # server can learn how many steps a grammar's answers really take
        self.jumped: dict[int, int] = {}
        # rid → those of its jumped tokens that rode along as rows of a step (the rest, a
        # last forced run, are never fed back): the work a forecast adds to its steps
        self.rode: dict[int, int] = {}

    def step_cost_model(self) -> LinearStepCost | None:
        return self.cost

    def clock_now(self) -> float:
        """Seconds since the run started, on the executor's clock."""
        return self._clock() - self._t0

    def start_clock(self, origin: float | None = None) -> None:
        """Start the executor's clock at zero now, or at ``origin`` (another executor's start)."""
        self._t0 = self._clock() if origin is None else origin
        self.now = self._clock() - self._t0

    @property
    def clock_origin(self) -> float:
        return self._t0

    def forget(self, rid: int) -> None:
        super().forget(rid)
        self.tokens.pop(rid, None)
        self._replay.pop(rid, None)
        self.stop_tokens.pop(rid, None)
        self.segmenters.pop(rid, None)
        self.samplers.pop(rid, None)
        self.logprob_logs.pop(rid, None)
        self.grammars.pop(rid, None)
        self._forced.pop(rid, None)
        self.jumped.pop(rid, None)
        self.rode.pop(rid, None)

    def close(self) -> None:
        """Remove swapped-out KV files and close the telemetry file."""
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
            self._spool, self._spooled = None, {}
        if self._telemetry is not None:
            self._telemetry.close()
            self._telemetry = None

    def _sleep_until(self, t: float) -> None:
        delay = t - (self._clock() - self._t0)
        if delay <= 0:
            return
        if self.skip_idle:
            self._t0 -= delay  # moving the origin back moves the run's clock forward
            self.idle_skipped_s += delay
        else:
            time.sleep(min(delay, 0.05))

    def _log_step(
        self,
        computed: int,
        attn: float,
        n_dec: int,
        kv: int,
        dt: float,
        chunks: list[tuple[int, int]],
    ) -> None:
        if self._telemetry_path is None:
            return
        if self._telemetry is None:
            self._telemetry_path.parent.mkdir(parents=True, exist_ok=True)
            self._telemetry = self._telemetry_path.open("w")
        row = {
            "t_s": round(self.now, 6),
            "step_s": round(dt, 6),
            "prefill_tokens": computed,  # less rows borrowed from another chunk
            "prefill_attn": attn,
            "prefill_chunks": chunks,  # (rows computed, end) of each: what attn counts
            "decode_seqs": n_dec,
            "kv_tokens_attended": kv,
            "kv_used_tokens": self.kv_used,
            "rss_bytes": rss_bytes(),
        }
        self._telemetry.write(json.dumps(row) + "\n")
