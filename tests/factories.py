"""Small builders for requests, jobs and snapshots used across the tests."""

from __future__ import annotations

import numpy as np

from duetime.core.cost import LinearStepCost
from duetime.core.request import Job, Request

SIMPLE_COST = LinearStepCost.batch(c=0.01, a=1e-4, b=1e-4, d=1e-6)


def job(
    rid: int,
    arrival: float = 0.0,
    prompt: int = 10,
    output: int = 5,
    deadline: float | None = None,
    **req_kwargs: object,
) -> Job:
    req = Request(rid=rid, arrival=arrival, prompt_len=prompt, deadline=deadline, **req_kwargs)  # type: ignore[arg-type]
    return Job(request=req, output_len=output)


def poisson_jobs(
    n: int,
    rate: float,
    seed: int = 0,
    prompt: tuple[int, int] = (10, 200),
    output: tuple[int, int] = (5, 200),
    slo: float | None = None,
) -> list[Job]:
    rng = np.random.default_rng(seed)
    arr = np.cumsum(rng.exponential(1.0 / rate, n))
    ps = rng.integers(prompt[0], prompt[1] + 1, n)
    os_ = rng.integers(output[0], output[1] + 1, n)
    return [
        job(
            i,
            float(arr[i]),
            int(ps[i]),
            int(os_[i]),
            deadline=None if slo is None else float(arr[i]) + slo,
        )
        for i in range(n)
    ]
