"""Shipped step-cost profiles and how to pick one by name or path."""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from duetime.core.cost import CostModelError, LinearStepCost
from duetime.sim.simulator import SimConfig

DEFAULT_PROFILE = "a100-llama2-7b"


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped in ``duetime/data/profiles``."""
    root = resources.files("duetime") / "data" / "profiles"
    return sorted(p.name.removesuffix(".json") for p in root.iterdir() if p.name.endswith(".json"))


def profile_path(name_or_path: str, option: str = "--profile") -> Path:
    """A shipped profile's path by name, or the given file path (``option``: where it
    was given, named when the name is unknown)."""
    p = Path(name_or_path)
    if p.suffix == ".json" or p.exists():
        return p
    root = resources.files("duetime") / "data" / "profiles"
    cand = Path(str(root / f"{name_or_path}.json"))
    if not cand.exists():
        raise CostModelError(
            f"unknown profile ({option}) {name_or_path!r}; shipped: "
            f"{', '.join(builtin_profiles())} (or give a path to a profile JSON)"
        )
    return cand


def load_profile(
    name_or_path: str = DEFAULT_PROFILE, option: str = "--profile"
) -> tuple[LinearStepCost, SimConfig]:
    """The cost model of a profile and the engine limits it records (defaults otherwise);
    ``option`` as for :func:`profile_path`."""
    path = profile_path(name_or_path, option)
    cost = LinearStepCost.from_profile(path)
    cfg = SimConfig()
    for key, attr in (
        ("kv_capacity_tokens", "kv_capacity"),
        ("max_num_seqs", "max_num_seqs"),
        ("max_batch_tokens", "max_batch_tokens"),
    ):
        if key in cost.meta:  # the profile's other fields
            value = cost.meta[key]
            if isinstance(value, bool) or not isinstance(value, int):  # int() took 1.7, "5000"
                raise CostModelError(f"{path}: {key} must be an integer, got {value!r}")
            if value < 1:
                raise CostModelError(f"{path}: {key} must be >= 1, got {value}")
            setattr(cfg, attr, value)
    return cost, cfg
