"""One-decorator router registry, as the policies' (``policies/registry.py``)."""

from __future__ import annotations

import inspect
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
    """Class decorator: make a router constructible by name in this process (the
    built-in ones also from the command line and the gateway)."""
    return _ROUTERS.register(name)


def make_router(name: str, *, seed: int = 0, **kwargs: Any) -> Router:
    """Build a registered router, with ``seed`` where its constructor takes one (the
    random ones draw from it; a router written to the protocol alone need not)."""
    factory = _ROUTERS.factory(name)
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # no signature to read: pass it, as always
        params = None
    takes_seed = (
        params is None
        or "seed" in params
        or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    )
    return factory(seed=seed, **kwargs) if takes_seed else factory(**kwargs)


def available_routers() -> list[str]:
    """Names of the registered routers (the built-in ones and any registered in this
    process), sorted."""
    return _ROUTERS.names()


def router_summaries() -> dict[str, str]:
    """Each router's name and what it does (its docstring's first line)."""
    return {name: _ROUTERS.summary(name) for name in _ROUTERS.names()}
