"""What a fleet is made of: replicas from profile names, or a fleet JSON.

A fleet JSON lists groups of identical replicas::

    {"replicas": [
        {"profile": "a100-llama2-7b", "count": 2},
        {"profile": "a100-llama2-7b", "count": 2, "slowdown": 2.0, "kv_capacity": 55000}
    ]}

``slowdown`` multiplies every step-cost coefficient (a slower accelerator running
the same model: 2.0 takes twice as long per step); ``kv_capacity`` and
``max_num_seqs`` override the profile's limits. Every key is checked, and an
unknown one is an error naming it, so a typo cannot silently give a uniform fleet.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from duetime.core.cost import LinearStepCost
from duetime.core.request import MAX_TIME_S
from duetime.sim.fleet import ReplicaSpec
from duetime.sim.profiles import load_profile
from duetime.sim.simulator import SimConfig

_COEFFS = ("c0", "c_prefill", "a1", "a2", "b", "d", "s", "e")
_KEYS = {"profile", "count", "slowdown", "kv_capacity", "max_num_seqs", "name"}


#: The largest slowdown a replica may have: one a thousand times slower serves nothing in
#: any run's span (1e308 overflowed the run's sums to inf, and the run went on).
MAX_SLOWDOWN = 1e3


def slowed(cost: LinearStepCost, factor: float) -> LinearStepCost:
    """``cost`` with every coefficient × ``factor`` (each step ``factor`` times as long)."""
    if not 0 < factor <= MAX_SLOWDOWN:  # NaN too
        raise ValueError(f"slowdown must be > 0 and <= {MAX_SLOWDOWN:g}, got {factor}")
    if factor == 1.0:
        return cost
    scaled = {k: getattr(cost, k) * factor for k in _COEFFS}
    return dataclasses.replace(cost, name=f"{cost.name}x{factor:g}", **scaled)


def _positive_int(where: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: {key} must be an integer >= 1, got {value!r}")
    return value


def replica(
    profile: str,
    *,
    slowdown: float = 1.0,
    kv_capacity: int | None = None,
    max_num_seqs: int | None = None,
    base: SimConfig | None = None,
    name: str | None = None,
    limits: Mapping[str, int] | None = None,
    option: str = "--replica-profile",
) -> ReplicaSpec:
    """One replica's spec: a profile, slowed and with its limits overridden. ``base``
    carries the run's other settings (prefix cache, max_time) onto every replica, and
    ``limits`` the run's own ``--kv-capacity`` / ``--max-num-seqs``, which stand where
    the replica sets none (they were dropped for the profile's, while the run's JSON
    recorded them)."""
    cost, cfg = load_profile(profile, option)
    if base is not None:
        cfg = dataclasses.replace(base, kv_capacity=cfg.kv_capacity, max_num_seqs=cfg.max_num_seqs)
    for key, value in (limits or {}).items():
        setattr(cfg, key, value)
    if kv_capacity is not None:
        cfg.kv_capacity = kv_capacity
    if max_num_seqs is not None:
        cfg.max_num_seqs = max_num_seqs
    cfg.check()
    label = name or (profile if slowdown == 1.0 else f"{profile}x{slowdown:g}")
    return ReplicaSpec(slowed(cost, slowdown), cfg, label)


def read_fleet(
    path: str | Path, base: SimConfig | None = None, limits: Mapping[str, int] | None = None
) -> list[ReplicaSpec]:
    """The replicas a fleet JSON lists (module docstring), in order; ``limits`` as for
    :func:`replica`."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--fleet {path}: cannot read a fleet JSON ({e})") from None
    groups = data.get("replicas") if isinstance(data, dict) else None
    if not isinstance(groups, list) or not groups:
        raise ValueError(f'--fleet {path}: expected {{"replicas": [{{"profile": ...}}, ...]}}')
    out: list[ReplicaSpec] = []
    for k, g in enumerate(groups):
        where = f"--fleet {path}, replicas[{k}]"
        if not isinstance(g, dict) or "profile" not in g:
            raise ValueError(f"{where}: each group needs a 'profile'")
        unknown = sorted(set(g) - _KEYS)
        if unknown:
            raise ValueError(f"{where}: unknown keys {unknown}; known: {sorted(_KEYS)}")
        count = _positive_int(where, "count", g.get("count", 1))
        slowdown = g.get("slowdown", 1.0)
        if isinstance(slowdown, bool) or not isinstance(slowdown, int | float):
            raise ValueError(f"{where}: slowdown must be a number, got {slowdown!r}")
        if not 0 < slowdown <= MAX_SLOWDOWN:  # named here, not by slowed(); NaN too
            raise ValueError(
                f"{where}: slowdown must be > 0 and <= {MAX_SLOWDOWN:g}, got {slowdown!r}"
            )
        own = {
            key: _positive_int(where, key, g[key])
            for key in ("kv_capacity", "max_num_seqs")
            if key in g
        }
        for _ in range(count):
            out.append(
                replica(
                    str(g["profile"]),
                    slowdown=float(slowdown),
                    base=base,
                    name=g.get("name"),
                    limits=limits,
                    option=f"{where}.profile",
                    **own,
                )
            )
    return out


def build_fleet(
    n: int,
    profiles: Sequence[str],
    fleet_json: str | None,
    base_profile: str,
    base: SimConfig,
    limits: Mapping[str, int] | None = None,
) -> list[ReplicaSpec]:
    """The replicas of a run: a fleet JSON, else the ``--replica-profile`` list (its
    length is the fleet's size; ``n`` must agree unless it is 1), else ``n`` copies
    of the run's profile with its limits (``base``). ``limits``: the run's
    ``--kv-capacity`` / ``--max-num-seqs``, for every replica that sets none."""
    if fleet_json is not None:
        if profiles:
            raise ValueError("give either --fleet or --replica-profile, not both")
        specs = read_fleet(fleet_json, base, limits)
    elif profiles:
        if n not in (1, len(profiles)):
            raise ValueError(
                f"--replicas {n} but {len(profiles)} --replica-profile given: they must agree"
            )
        specs = [replica(p, base=base, limits=limits) for p in profiles]
    else:
        cost, _ = load_profile(base_profile)
        specs = [ReplicaSpec(cost, dataclasses.replace(base), base_profile) for _ in range(n)]
    if n > 1 and len(specs) != n:
        raise ValueError(f"--replicas {n} but the fleet JSON lists {len(specs)} replicas")
    return specs


def parse_failure(text: str) -> tuple[int, float]:
    """``REPLICA@SECONDS`` (``--fail 2@30``: replica 2 fails 30 s into the run)."""
    idx, sep, at = text.partition("@")
    try:
        if not sep:
            raise ValueError
        i, t = int(idx), float(at)
    except ValueError:
        raise ValueError(f"--fail takes REPLICA@SECONDS (e.g. 2@30), got {text!r}") from None
    if i < 0 or not 0 <= t <= MAX_TIME_S:  # NaN and inf too
        raise ValueError(
            f"--fail {text!r}: the replica must be >= 0 and the time in [0, {MAX_TIME_S:.0e}] s"
        )
    return i, t
