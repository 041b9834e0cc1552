"""Earliest forecast finish with deadline admission (duetime's own).

Source: this project (``docs/fleet.md``). Rule: forecast, for every up replica,
when the request would finish there (the replica's engine image played forward
under its own policy and cost model: ``sim/forecast.py``, the code the server's
admission runs). A request with a deadline that no replica's forecast meets is
refused at arrival, with ``retry_after_s`` = how late the best replica would
be. Otherwise it goes where its slack (deadline − forecast finish) is largest,
which is where it finishes earliest; a request without a deadline goes where it
finishes earliest too. Ties go to the lowest index.

Why largest slack, and not least added fleet lateness: the slack needs one
forecast per replica, the added lateness two (each replica with and without the
request); the requests already on a replica are mostly protected from a newcomer
by its policy (FCFS never puts the newcomer ahead, EDF only when its deadline is
earlier), so what a newcomer adds is batch slowdown, small beside its own
lateness; and the largest margin is the one that best survives the forecast's
errors, which come from predicted answer lengths.
"""

from __future__ import annotations

import math

from duetime.core.router import FleetSnapshot, Refuse, Route, RouteDecision
from duetime.routers.registry import register


@register("forecast")
class ForecastDeadline:
    """Forecast every up replica; refuse when none meets the deadline, else the earliest finish."""

    name = "forecast"

    def __init__(self, seed: int = 0) -> None:
        pass

    def route(self, snap: FleetSnapshot) -> RouteDecision:
        best, best_end = -1, math.inf
        for i in snap.up_indices():
            end = snap.forecast(int(i))
            if end is not None and end < best_end:
                best, best_end = int(i), end
        due = snap.request.deadline
        if due is not None and (best < 0 or best_end > due + 1e-12):
            late = "not within its horizon" if best < 0 else f"{_seconds(best_end - due)} late"
            return Refuse(
                f"no replica can meet the deadline: the best forecast is {late}",
                retry_after_s=max(1.0, 0.0 if best < 0 else best_end - due),
            )
        if best < 0:  # no deadline, and no forecast finished: the least loaded
            load = snap.outstanding
            ups = snap.up_indices()
            best = int(ups[load[ups].argmin()])
        return Route(best)


def _seconds(s: float) -> str:
    """A lateness as a person reads it: "1.25 s", or "3.2 ms" under a second ("0.00 s"
    said a request was refused for being on time)."""
    return f"{s:.2f} s" if s >= 1.0 else f"{s * 1000:.3g} ms"
