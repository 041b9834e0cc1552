"""One-decorator router registry, as the policies' (``policies/registry.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from duetime.core.router import Router

_REGISTRY: dict[str, Callable[..., Router]] = {}
T = TypeVar("T", bound=Callable[..., Router])


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make a router constructible by name (CLI, sweeps, benchmarks)."""

    def deco(factory: T) -> T:
        if name in _REGISTRY:
            raise ValueError(f"router {name!r} registered twice")
        _REGISTRY[name] = factory
        return factory

    return deco


def make_router(name: str, *, seed: int = 0, **kwargs: Any) -> Router:
    """Build a registered router; every router takes ``seed`` (the random ones use it)."""
    _load_builtin()
    try:
        factory = _REGISTRY[name]
    except KeyError:
        known = ", ".join(sorted(_REGISTRY))
        raise ValueError(f"unknown router {name!r}; known routers: {known}") from None
    return factory(seed=seed, **kwargs)


def available_routers() -> list[str]:
    """Names of the built-in routers, sorted."""
    _load_builtin()
    return sorted(_REGISTRY)


def _load_builtin() -> None:
    # Importing the modules runs their @register decorators.
    from duetime.routers import (  # noqa: F401
        forecast_deadline,
        least_kv,
        least_outstanding,
        power_of_two,
        prefix_affinity,
        random_choice,
        round_robin,
        shortest_queue,
    )
