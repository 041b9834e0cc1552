"""One-decorator router registry, as the policies' (``policies/registry.py``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from duetime.core.registry import Registry
from duetime.core.router import Router

T = TypeVar("T", bound=Callable[..., Router])

#: The modules whose @register decorators define the built-in routers.
_BUILTIN = ("forecast_deadline", "least_kv", "least_outstanding", "power_of_two",
            "prefix_affinity", "random_choice", "round_robin", "shortest_queue")  # fmt: skip
_ROUTERS: Registry[Router] = Registry("router", "routers", "duetime.routers", _BUILTIN)


def register(name: str) -> Callable[[T], T]:
    """Class decorator: make a router constructible by name (CLI, sweeps, benchmarks)."""
    return _ROUTERS.register(name)


def make_router(name: str, *, seed: int = 0, **kwargs: Any) -> Router:
    """Build a registered router; every router takes ``seed`` (the random ones use it)."""
    return _ROUTERS.factory(name)(seed=seed, **kwargs)


def available_routers() -> list[str]:
    """Names of the built-in routers, sorted."""
    return _ROUTERS.names()


def router_summaries() -> dict[str, str]:
    """Each router's name and what it does (its docstring's first line)."""
    return {name: _ROUTERS.summary(name) for name in _ROUTERS.names()}
