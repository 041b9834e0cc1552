"""Bounds the real-engine benches share, in a module light enough for option help texts."""

from __future__ import annotations

#: Most requests one real-engine run takes (``validate``, ``bench amin --engine``,
#: ``bench deferred-prefill --engine``): at the engine's tens of steps a second,
#: 100,000 short requests are hours of compute already, while 10^8 grew memory
#: building the workload and never reached a step. The simulator's commands take more.
MAX_ENGINE_REQUESTS = 100_000


def check_engine_requests(requests: int) -> None:
    """Refuse more requests than a real-engine run is for (:data:`MAX_ENGINE_REQUESTS`)."""
    if requests > MAX_ENGINE_REQUESTS:
        raise ValueError(
            f"--requests {requests:,}: a real-engine run takes at most {MAX_ENGINE_REQUESTS:,} "
            "(hours of engine time already); the simulator's commands take more"
        )
