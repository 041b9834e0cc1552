"""The gateway's backends as a fleet for the routers of :mod:`duetime.core.router`.

A router sees a :class:`~duetime.core.router.FleetSnapshot` and never learns
whether simulated replicas (``sim/fleet.py``) or the gateway's backends are
behind it. This module builds that snapshot from what the gateway knows of each
backend, with no I/O and an explicit clock:

* from a fresh scrape of the backend's own ``/metrics`` (:mod:`.backend_load`):
  ``running`` and ``waiting`` as the backend counts them (other clients' requests
  included), moved by what the gateway sent and saw end since the scrape, plus the
  requests the gateway holds for a slot there; ``kv_used`` / ``kv_capacity`` in
  tokens; ``prefix_hit(i)`` the prompt's length times the backend's recent
  prefix-cache hit rate (the share of queried prompt tokens its cache supplied:
  a backend-wide figure, not this prompt's own match);
* without one (scraping off, none yet, or older than the staleness bound): the
  gateway's own counts: ``running`` its requests in flight there, ``waiting``
  those it holds for a slot there, ``kv_used`` / ``kv_capacity`` 0 / 1 and every
  prefix hit 0 (so those routers fall back to their load tie-break);
* ``forecast(i)``: when the request would end there, the backend taken as a batch
  of ``limit`` slots (the gateway's in-flight limit, or the largest batch the
  backend's cost model says it runs, ``max_num_seqs``, where that is fewer):
  ``now + wait + service``.
  ``service`` is the request's own time, ``ttft + tpot * max_tokens`` from the
  backend's moving averages (before its first answer, its published cost model on
  this request's prompt and length, where it publishes one), both for one sequence
  alone (an answer's pace is divided by the model's slowdown at the batch it ended
  in), its decode part times the published model's slowdown at the batch the
  request joins (``min(ahead + 1, limit)``, ``ahead`` the running plus waiting
  count), both at the request's mean context (:attr:`Ask.context`).
  ``wait`` is ``max(0, ahead + 1 - limit) * service / limit``: past the limit, a
  slot frees about every ``service / limit``. Why not ``(ahead + 1) * service``:
  the averages come from answers that ran in a batch already, and pricing each
  request ahead at a whole request time, as if the backend served one at a time,
  refused 15 of 28 requests with a 7.1 s deadline on a real two-backend fleet whose
  answers took 2.4 s (p50);
* ``first(i)``: when its first token would come there: ``now + wait`` plus the
  prompts ahead of it in that backend's prefill queue and its own
  (:meth:`.Backend.first_token_time`); the TTFT bound is judged on it;
* ``up``: the backends the request may go to. Down ones, those not serving its
  model and those a retry excludes are never offered; suspect ones only when all
  are; with a TTFT bound only those whose first-token forecast meets it; and a
  backend at its in-flight limit only when none has room (a request sent where
  a slot is free starts now; the others wait for one).

The gateway answers on its own where the simulated fleet does: 503 when no
backend is up for the model (the fleet's "every replica is down"), and 429 when
no backend's first-token forecast meets the request's TTFT bound, a bound the
simulator's requests do not carry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from duetime.core.request import Request
from duetime.core.router import FleetSnapshot
from duetime.server.errors import ApiError
from duetime.server.gateway_routing import Backend, routable

_EPS = 1e-9  # a forecast equal to its bound meets it (float noise aside)


@dataclass(slots=True, frozen=True)
class Ask:
    """What the gateway reads of a request to route it; times in seconds after arrival."""

    max_tokens: int
    deadline_s: float | None = None  # the whole answer
    ttft_s: float | None = None  # the first token (llm-d's x-slo-ttft-ms)
    priority: int = 0
    model: str | None = None
    prompt_len: int = 1  # the gateway does not tokenize: a rough count, >= 1

    @property
    def context(self) -> int:
        """Tokens its sequence attends on average over its answer: the context at which
        the gateway prices its batch slowdown and normalises its answer's pace."""
        return max(1, self.prompt_len) + self.max_tokens // 2

    def later(self, elapsed_s: float) -> Ask:
        """The same ask ``elapsed_s`` later (a retry): its bounds are that much closer."""

        def less(t: float | None) -> float | None:
            return None if t is None else t - elapsed_s

        return Ask(
            self.max_tokens,
            less(self.deadline_s),
            less(self.ttft_s),
            self.priority,
            self.model,
            self.prompt_len,
        )


@dataclass(slots=True, frozen=True)
class Grant:
    """A backend slot, and the forecasts it was routed on (seconds after arrival)."""

    backend: Backend
    forecast_s: float
    first_token_s: float
    context: int = 1  # the ask's :attr:`Ask.context`, for the answer's observed pace


@dataclass(slots=True)
class Offer:
    """One routing question: the router's snapshot and the forecasts behind it.

    The forecasts are plain floats, computed backend by backend: a fleet is a handful
    of backends, where numpy's per-call cost made it 2-2.4x slower (57 vs 24 µs at one
    backend, 150 vs 78 µs at four)."""

    snap: FleetSnapshot
    finish: list[float]  # absolute forecast finish per backend
    first: list[float]  # absolute forecast first token per backend


def no_backend(model: str | None) -> ApiError:
    """503: nothing up that serves ``model`` (the fleet's own refusal)."""
    what = "no backend" if model is None else f"no backend serving {model!r}"
    return ApiError(503, f"{what} is up", type="server_error", code="no_backend")


def refusal(message: str, retry_after_s: float, code: str) -> ApiError:
    """429 with ``Retry-After`` (whole seconds, at least 1) and the reason."""
    after = max(1, math.ceil(retry_after_s)) if math.isfinite(retry_after_s) else 1
    return ApiError(
        429, message, type="rate_limit_error", code=code, headers={"Retry-After": str(after)}
    )


def make_offer(
    backends: list[Backend],
    queued: list[int],
    ask: Ask,
    *,
    rid: int,
    arrival: float,
    now: float,
    mono: float,
    max_inflight: int,
    exclude: frozenset[str] = frozenset(),
    max_age_s: float | None = None,
) -> Offer:
    """The snapshot for ``ask`` at ``now`` (gateway clock; ``mono``: the monotonic clock
    the suspect cool-downs and scrape ages count on). ``max_age_s``: the age past which
    a backend's scrape is not used (None: scrapes are not used at all). Raises the
    gateway's own 503 / 429."""
    n = len(backends)
    usable = [b.up and b.serves(ask.model) and b.url not in exclude for b in backends]
    if not any(usable):
        raise no_backend(ask.model)
    pool = {id(b) for b in routable([b for b, u in zip(backends, usable, strict=True) if u], mono)}
    offered = [id(b) in pool for b in backends]
    in_flight = [b.in_flight for b in backends]
    # the snapshot's arrays, filled in place from fresh scrapes
    running = np.array(in_flight, dtype=np.int64)
    waiting = np.array(queued, dtype=np.int64)
    kv_used = np.zeros(n, dtype=np.int64)
    kv_capacity = np.ones(n, dtype=np.int64)
    hit_rate = [0.0] * n
    if max_age_s is not None:
        for i, b in enumerate(backends):
            if b.scrape.fresh(mono, max_age_s):
                e = b.scrape.estimate(b.sent, b.done, ask.prompt_len)
                running[i], kv_used[i], kv_capacity[i] = e.running, e.kv_used, e.kv_capacity
                waiting[i] += e.waiting  # the backend's queue, then the gateway's for it
                hit_rate[i] = e.hit_rate
    limit = [b.limit(mono, max_inflight) for b in backends]
    slots = [b.batch_slots(lim) for b, lim in zip(backends, limit, strict=True)]
    finish: list[float] = []
    first: list[float] = []
    context = ask.context
    for b, run, wait, lim in zip(backends, running.tolist(), waiting.tolist(), slots, strict=True):
        ttft, alone = b.estimates(ask.prompt_len, ask.max_tokens)
        ahead = run + wait
        # the decode steps slow with the batch; the first token's wait is its own
        service = ttft + (alone - ttft) * b.slowdown(min(ahead + 1, lim), context)
        # A slot frees about every service / limit seconds once the backend is full.
        slot_wait = max(0, ahead + 1 - lim) * service / lim
        finish.append(now + slot_wait + service)
        first.append(now + slot_wait + b.first_token_time(ask.prompt_len, ttft, run, context))
    if ask.ttft_s is not None:
        due = arrival + ask.ttft_s
        meets = [o and f <= due + _EPS for o, f in zip(offered, first, strict=True)]
        if not any(meets):
            late = min(f for o, f in zip(offered, first, strict=True) if o) - due
            raise refusal(
                f"no backend can send the first token within {ask.ttft_s * 1000:g} ms "
                f"(x-slo-ttft-ms): the earliest forecast is {late * 1000:.3g} ms late",
                late,
                "ttft_unreachable",
            )
        offered = meets
    # the gateway's own slots decide who starts now
    room = [o and f < lim for o, f, lim in zip(offered, in_flight, limit, strict=True)]
    if any(room):
        offered = room
    deadline = None if ask.deadline_s is None else arrival + ask.deadline_s
    req = Request(
        rid=rid,
        arrival=arrival,
        prompt_len=max(1, ask.prompt_len),
        max_tokens=ask.max_tokens,
        deadline=deadline,
        priority=ask.priority,
    )
    snap = FleetSnapshot(
        now=now,
        request=req,
        up=np.array(offered, dtype=bool),
        running=running,
        waiting=waiting,
        kv_used=kv_used,
        kv_capacity=kv_capacity,
        prefix_lookup=lambda i: round(req.prompt_len * hit_rate[i]),
        forecast_of=lambda i: finish[i],
    )
    return Offer(snap, finish, first)
