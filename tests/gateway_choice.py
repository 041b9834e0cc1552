"""Where the gateway's router sends a request, for tests that set backend states by hand.

``estimate_rule`` is the gateway's forecast written out on its own for backends
with no published cost model, as a reference: the up backend with room and the
earliest finish, which for a backend with a free slot is its request time ``ttft +
tpot * max_tokens`` (the request joins its batch now), passing over suspect
backends while another serves the model, one request at a time on probation. The
``forecast`` router on the gateway's snapshot must choose as it does.
"""

from __future__ import annotations

import math
from typing import Any

from duetime.core.router import Route
from duetime.routers import make_router
from duetime.server.gateway import Ask, Backend, make_offer, routable


def estimate_rule(
    backends: list[Backend], max_tokens: int, max_inflight: int, model: str | None, mono: float
) -> Backend | None:
    """The reference choice (None: every backend it may use is full)."""
    usable = [b for b in backends if b.up and b.serves(model)]
    best: Backend | None = None
    best_t = math.inf
    for b in routable(usable, mono):
        if b.in_flight >= b.limit(mono, max_inflight):
            continue
        t = b.ttft_s + b.tpot_s * max(1, max_tokens)
        if t < best_t:
            best, best_t = b, t
    return best


def offer(
    backends: list[Backend],
    ask: Ask,
    *,
    max_inflight: int,
    mono: float = 0.0,
    max_age_s: float | None = None,
) -> Any:
    """The gateway's snapshot for ``ask`` with nothing queued, at gateway time 0."""
    return make_offer(
        backends,
        [0] * len(backends),
        ask,
        rid=1,
        arrival=0.0,
        now=0.0,
        mono=mono,
        max_inflight=max_inflight,
        max_age_s=max_age_s,
    )


def routed(
    backends: list[Backend],
    max_tokens: int,
    *,
    max_inflight: int,
    mono: float,
    model: str | None = None,
    router: str = "forecast",
) -> tuple[Backend, bool]:
    """The backend ``router`` picks on the gateway's snapshot (nothing queued, now 0),
    and whether it has a slot free now (else the request waits for one there)."""
    snap = offer(backends, Ask(max_tokens, model=model), max_inflight=max_inflight, mono=mono).snap
    dec = make_router(router).route(snap)
    assert isinstance(dec, Route), dec
    b = backends[dec.replica]
    return b, b.in_flight < b.limit(mono, max_inflight)
