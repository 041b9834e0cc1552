"""When will each request finish? Fork the simulator from a live engine's image.

The architecture's one rule (a policy never knows which executor drives it) makes
this possible: the engine's state, taken as an :class:`EngineImage`, becomes the
state of a :class:`Simulator` running a fork of the same policy (its private
state as the image recorded it) on the engine's fitted step-cost model, and the
simulator plays the future out in milliseconds. What it cannot know it is told:
how long each answer will be (``job_of``: the length predictor's estimate, say).
A server asks before it admits a request with a deadline
(``server/admission.py``): the forecast sees what a formula cannot, such as a
full batch that the request must wait for, the batch growing as the queue
drains, and where the policy will put it.

A forecast is as good as its inputs: with exact lengths, the image's fork of the
policy and no prefix cache, it repeats the uninterrupted simulation (tested); on
the real engine its errors are the length predictor's and the cost model's.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass

from duetime.core.cost import CostModel
from duetime.core.image import EngineImage, LiveSeq
from duetime.core.policy import Policy
from duetime.core.prefix_cache import ROOT_KEY, chain_keys
from duetime.core.request import Job
from duetime.sim.simulator import SimConfig, Simulator

__all__ = ["Forecast", "forecast"]


@dataclass(slots=True, frozen=True)
class Forecast:
    """Predicted times (on the image's clock) of every request the fork played.

    ``finish[rid]`` is None for a request the fork did not finish by its horizon or
    that its policy cancelled.
    """

    finish: Mapping[int, float | None]
    first_token: Mapping[int, float | None]
    sim_time: float
    engine_steps: int
    wall_s: float

    def misses(self, rids: Iterable[int], deadlines: Mapping[int, float]) -> list[int]:
        """Those of ``rids`` with a deadline that the forecast has them miss."""
        out = []
        for rid in rids:
            due = deadlines.get(rid)
            end = self.finish.get(rid)
            if due is not None and (end is None or end > due):
                out.append(rid)
        return out


def forecast(
    image: EngineImage,
    policy: Policy,
    cost: CostModel,
    *,
    job_of: Callable[[LiveSeq], Job],
    arrivals: Iterable[Job] = (),
    cached: Mapping[int, int] | None = None,
    horizon: float = math.inf,
    watch: Collection[int] = (),
) -> Forecast:
    """Play ``image`` forward in the simulator until every request finished (or the
    clock reaches ``horizon``, absolute).

    ``policy`` runs the fork and is changed by it: :meth:`EngineImage.fork_policy`
    (the executor's policy in the state the image records), or where that is None a
    fresh instance, which starts without what the original remembered; ``job_of``
    says what is taken to be true of each request in the image (its answer's length:
    a prediction, on a server); ``arrivals`` are requests still to come (their
    ``output_len`` is the length assumed for them); ``cached[rid]`` is how many
    first prompt tokens of an arrival the engine's prefix cache holds now: the
    fork's cache starts with them. With ``watch``, the fork stops once those
    requests have ended.
    """
    t0 = time.perf_counter()
    config = SimConfig(max_time=horizon, **image.limits())
    sim = Simulator(policy, cost, config)
    sim.restore(image, job_of)
    jobs = list(arrivals)
    if cached and sim.prefix_cache is not None:
        _seed(sim, jobs, cached)
    records = sim.records

    def watched_ended() -> bool:
        for rid in watch:
            rec = records.get(rid)
            if rec is None or (rec.finish is None and rec.cancelled_at is None):
                return False
        return True

    sim.run(jobs, until=watched_ended if watch else None)
    return Forecast(
        finish={rid: rec.finish for rid, rec in records.items()},
        first_token={rid: rec.first_token for rid, rec in records.items()},
        sim_time=sim.now,
        engine_steps=sim.engine_steps,
        wall_s=time.perf_counter() - t0,
    )


def _seed(sim: Simulator, jobs: list[Job], cached: Mapping[int, int]) -> None:
    """Put the blocks the engine's cache holds of the arrivals' prompts in the fork's."""
    cache = sim.prefix_cache
    assert cache is not None
    for job in jobs:
        req = job.request
        ids, n = req.prompt_token_ids, cached.get(req.rid, 0)
        if ids is None or n <= 0:
            continue
        parent = ROOT_KEY
        for key in chain_keys(ids, n // cache.block_size, cache.block_size):
            cache.insert(key, parent, None)
            parent = key
