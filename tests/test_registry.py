"""The named-factory registry behind `make_policy` and `make_router`."""

from __future__ import annotations

import subprocess
import sys

import pytest

from duetime.core.registry import Registry
from duetime.policies.registry import available_policies, make_policy
from duetime.routers.registry import available_routers, make_router


class _A:
    pass


class _B:
    pass


def test_registry_refuses_a_name_twice_and_lists_the_known_ones() -> None:
    reg: Registry[object] = Registry("thing", "things", "duetime.policies", ())
    reg.register("a")(_A)
    reg.register("a")(_A)  # the same class again (a notebook cell run twice): itself
    with pytest.raises(ValueError, match=r"thing 'a' is registered already, by .*_A: give .*_B"):
        reg.register("a")(_B)
    with pytest.raises(ValueError, match="unknown thing 'b'; known things: a"):
        reg.factory("b")
    assert reg.names() == ["a"]


def test_every_builtin_policy_and_router_is_built_by_name() -> None:
    assert "edf" in available_policies()
    assert "round-robin" in available_routers()
    for name in available_policies():
        assert make_policy(name) is not None
    for name in available_routers():
        assert make_router(name) is not None
    with pytest.raises(ValueError, match="unknown policy 'nope'; known policies: "):
        make_policy("nope")
    with pytest.raises(ValueError, match="unknown router 'nope'; known routers: "):
        make_router("nope")


def test_a_users_policy_under_a_builtin_name_is_refused_at_its_own_decorator() -> None:
    """Registered before the first look-up, it broke every later one ("registered
    twice", raised from importing the built-ins)."""
    script = """
from duetime.policies import register
from duetime.policies.base import QueuePolicy
try:
    @register("fcfs")
    class Mine(QueuePolicy):
        pass
except ValueError as e:
    print("refused:", e)

@register("mine")
class Other(QueuePolicy):
    name = "mine"

from duetime.policies import make_policy
print(type(make_policy("fcfs")).__module__, type(make_policy("mine")).__name__)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.splitlines()
    assert "policy 'fcfs' is registered already (a built-in)" in first
    assert "give __main__.Mine another name" in first
    assert second == "duetime.policies.fcfs Other"


def test_a_router_written_to_the_protocol_alone_is_built_without_a_seed() -> None:
    from duetime.core.router import Route
    from duetime.routers import registry

    @registry.register("test-no-seed")
    class NoSeed:
        name = "test-no-seed"

        def route(self, snap: object) -> Route:
            return Route(0)

    try:
        assert isinstance(make_router("test-no-seed", seed=3), NoSeed)
    finally:  # the registry is the process's: other tests list every router
        registry._ROUTERS._factories.pop("test-no-seed")
