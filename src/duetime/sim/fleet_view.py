"""The two costly figures of a fleet snapshot, for a simulated replica: its prefix
cache's hit for a request and its forecast of when the request would finish.

The forecast is :func:`duetime.sim.forecast.forecast`, the function the server's
admission calls (``server/admission.py``), run on the replica's
:class:`~duetime.core.image.EngineImage` under a fork of its policy and its cost
model. Like the server it does not know how long answers will be: each request
is taken to need its predicted length (without a prediction, its ``max_tokens``),
the rule of ``core.request.assumed_answer``, as server admission; a router sees no oracle.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from duetime.core.image import LiveSeq
from duetime.core.policy import Policy
from duetime.core.request import Job, Request, assumed_answer
from duetime.core.sequence import Seq
from duetime.sim.forecast import forecast
from duetime.sim.replica import Replica


def prefix_hit(replica: Replica, req: Request) -> int:
    """Prompt tokens of ``req`` whose KV ``replica``'s prefix cache holds now (0 without
    one), counted as the replica would count them at admission."""
    sim = replica.sim
    cache = sim.prefix_cache
    if cache is None:
        return 0
    seq = Seq(req, sim.clock, -1)
    n_blocks = sim._hit_limit(seq) // cache.block_size
    return cache.peek(sim._block_keys(seq, n_blocks))


def forecast_finish(
    replica: Replica, req: Request, now: float, fresh_policy: Callable[[], Policy]
) -> float | None:
    """When ``req``, arriving at ``now``, would finish on ``replica`` (absolute; None when
    not within twice its time budget, or ever for one without a deadline)."""
    sim = replica.sim
    image = sim.image()
    policy = image.fork_policy() or fresh_policy()
    arrivals = [Job(j.request, output_len=assumed_answer(j.request)) for _, j in replica.inbox]
    arrivals.append(Job(req, output_len=assumed_answer(req)))
    horizon = math.inf
    if req.deadline is not None:
        horizon = req.deadline + max(req.deadline - now, 1.0)  # far enough to say how late

    def job_of(live: LiveSeq) -> Job:
        return Job(live.request, output_len=assumed_answer(live.request, live.generated))

    hit = prefix_hit(replica, req)
    fc = forecast(
        image,
        policy,
        sim.cost,
        job_of=job_of,
        arrivals=arrivals,
        cached={req.rid: hit} if hit else None,
        horizon=horizon,
        watch=[req.rid],
    )
    return fc.finish.get(req.rid)
