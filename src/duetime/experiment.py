"""One simulated experiment, described by plain data so sweeps can ship it to workers.

``SimSpec`` names everything a run depends on (workload, arrivals, policy,
profile, predictor, seed); :func:`run_spec` builds the jobs, runs the
simulator and returns the records with a summary. The same spec always gives
the same result: that is what makes sweeps over process pools or Ray
reproducible.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import asdict, dataclass
from dataclasses import fields as dataclass_fields
from pathlib import Path
from typing import Any

from duetime.core.cost import LinearStepCost
from duetime.core.policy import Policy
from duetime.core.record import RequestRecord
from duetime.core.request import Job
from duetime.metrics import SLO, cached_prompt_pct, summarize
from duetime.policies import make_policy
from duetime.predict.oracle import JobPredictor, make_job_predictor
from duetime.sim import SimConfig, SimResult, Simulator
from duetime.sim.profiles import DEFAULT_PROFILE, load_profile


@dataclass(slots=True)
class SimSpec:
    """Everything one simulated run depends on.

    ``workload``: ``sharegpt``, ``sharegpt-heldout`` (only the rows the shipped
    length predictors were tested on, never trained on: the fair workload for
    ``learned`` predictors), ``synthetic`` or a path to a JSONL trace (then the
    :data:`GENERATED_ONLY` fields play no part). ``deadline_scale``:
    when set, each request without a deadline gets
    ``arrival + deadline_scale × (its time alone on the profile)``, the usual
    "slack" definition of a deadline. ``predictor``: ``policy`` (the policy's
    own default) or any ``--predictor`` spec: ``none``, ``oracle``, ``noisy[:<rel_error>]``,
    ``interval:...``, ``learned[:<model>]`` (docs/policies.md lists them).
    ``shared_prefix`` > 0 puts one of ``prefix_groups`` system prompts of that many
    tokens in front of every generated prompt (:class:`~duetime.workloads.SharedPrefix`);
    ``prefix_cache`` is the simulated prefix cache's budget in tokens (0: none).
    ``replicas``, ``router``, ``replica_profiles``, ``fleet`` and ``failures``
    describe a fleet (``docs/fleet.md``); left at their defaults, one engine.
    """

    policy: str = "fcfs"
    workload: str = "sharegpt"
    requests: int = 2000
    rate: float = 4.0
    arrival: str = "poisson"
    cv: float = 1.0
    burst_size: int = 1
    seed: int = 0
    profile: str = DEFAULT_PROFILE
    predictor: str = "policy"
    deadline_scale: float | None = None
    max_context: int = 4096
    kv_capacity: int | None = None
    max_num_seqs: int | None = None
    prefix_cache: int = 0
    shared_prefix: int = 0
    prefix_groups: int = 1
    # A fleet (``sim/fleet_run.py``) when any of these is set: N replicas behind a router,
    # from the profile, a --replica-profile list or a fleet JSON; failures: (replica, s).
    replicas: int = 1
    router: str | None = None
    replica_profiles: tuple[str, ...] = ()
    fleet: str | None = None
    failures: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        _check_field_types(self)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def recorded(self) -> dict[str, Any]:
        """The spec as a result file keeps it: for a trace, the fields that played no
        part (:data:`GENERATED_ONLY`) are null, not the defaults nobody chose; an
        infinite rate (all at once) as ``"inf"``, what ``--rate`` takes (strict JSON has
        no number for it, and null is a trace's)."""
        fields = asdict(self)
        if is_trace(self):
            fields.update(dict.fromkeys(GENERATED_ONLY))
        elif math.isinf(self.rate):
            fields["rate"] = "inf"
        return fields


#: What each scalar annotation of :class:`SimSpec` admits (numpy numbers included).
_KINDS: dict[str, tuple[str, tuple[type, ...]]] = {
    "int": ("an int", (numbers.Integral,)),
    "float": ("a number", (numbers.Real,)),
    "str": ("a str", (str,)),
}


def _check_field_types(spec: SimSpec) -> None:
    """A value of the wrong type is named here, not by the numpy or comparison error it
    causes deep in a run (``rate="8"``: "'>' not supported between 'str' and 'int'")."""
    for f in dataclass_fields(spec):
        kind, _, optional = str(f.type).partition(" | ")
        if kind not in _KINDS or (optional not in ("", "None")):
            continue
        value = getattr(spec, f.name)
        words, types = _KINDS[kind]
        if value is None and optional:
            continue
        if isinstance(value, bool) or not isinstance(value, types):
            raise ValueError(
                f"SimSpec.{f.name} must be {words}{' or None' if optional else ''}, "
                f"got {value!r} ({type(value).__name__})"
            )


#: ``SimSpec.workload`` names other than these are trace files.
GENERATED_WORKLOADS = ("sharegpt", "sharegpt-heldout", "synthetic")
#: The fields that draw a generated workload; a trace brings its own requests and
#: arrival times, so these play no part in it.
GENERATED_ONLY = ("requests", "rate", "arrival", "cv", "burst_size")


def is_trace(spec: SimSpec) -> bool:
    """Whether the spec replays a trace file (its arrival times: ``rate`` plays no part)."""
    return spec.workload not in GENERATED_WORKLOADS


def build_jobs(spec: SimSpec) -> list[Job]:
    """The workload of a spec (deadlines are added by :func:`plan_spec`)."""
    from duetime import workloads as wl
    from duetime.workloads.trace_name import check_trace_exists

    if is_trace(spec):
        if spec.shared_prefix:
            raise ValueError(
                "--shared-prefix applies to generated workloads; a trace names its prefixes "
                "(prefix_group, prefix_len)"
            )
        check_trace_exists(spec.workload, f"use {', '.join(GENERATED_WORKLOADS)}")
        return wl.read_trace(spec.workload)
    arrivals = wl.arrival_process(spec.arrival, spec.rate, cv=spec.cv, burst_size=spec.burst_size)
    source: wl.LengthSource | None = None
    if spec.workload == "synthetic":
        source = wl.SyntheticSource(prompt_len=(16, 1024), output_len=(16, 512))
    elif spec.workload == "sharegpt-heldout":
        from duetime.predict.length_data import heldout_rows

        lengths = wl.load_sharegpt_lengths()
        source = wl.ShareGPTSource(lengths, pool=heldout_rows(lengths))
    caps = wl.LengthCaps(max_total_len=spec.max_context)
    return wl.build_jobs(
        spec.requests,
        source=source,
        arrivals=arrivals,
        seed=spec.seed,
        caps=caps,
        with_prompt_text=spec.workload.startswith("sharegpt")
        and spec.predictor.startswith("learned"),
        shared_prefix=(
            wl.SharedPrefix(spec.shared_prefix, spec.prefix_groups) if spec.shared_prefix else None
        ),
    )


#: The workloads whose requests carry their prompt's text (what ``learned`` reads).
PROMPT_WORKLOADS = ("sharegpt", "sharegpt-heldout")


def check_predictor_workload(pred_name: str | None, spec: SimSpec) -> None:
    """Refuse a learned length predictor on a workload without prompts, up front."""
    if pred_name is None or pred_name.partition(":")[0] != "learned":
        return
    if spec.workload not in PROMPT_WORKLOADS:
        given = "--predictor" if spec.predictor != "policy" else f"{spec.policy}'s predictor"
        raise ValueError(
            f"{given} {pred_name} reads each request's prompt: only the "
            f"{' and '.join(PROMPT_WORKLOADS)} workloads carry prompts (synthetic and trace "
            "files do not), "
            f"got --workload {spec.workload}"
        )


#: A deadline a million times a request's time alone is none: past it, a deadline of a
#: long request passes the 1e9 s a run can time (and a saved trace refuses it).
MAX_DEADLINE_SCALE = 1e6


def assign_deadlines(jobs: list[Job], cost: LinearStepCost, scale: float) -> None:
    """deadline = arrival + scale × (prefill + decode of the request alone)."""
    # NaN would silently drop every deadline; 1e300 ran, then its trace could not be saved
    if not 0 < scale <= MAX_DEADLINE_SCALE:
        raise ValueError(f"--deadline-scale must be > 0 and <= {MAX_DEADLINE_SCALE:g}, got {scale}")
    for job in jobs:
        req = job.request
        if req.deadline is None:
            alone = cost.prefill_time(req.prompt_len)
            alone += cost.decode_span(job.output_len - 1, 1, req.prompt_len)
            req.deadline = req.arrival + scale * alone


def sim_config(spec: SimSpec) -> tuple[LinearStepCost, SimConfig]:
    if spec.replicas < 1:  # 0 is not a fleet: it ran one engine
        raise ValueError(f"--replicas must be >= 1, got {spec.replicas}")
    cost, cfg = load_profile(spec.profile)
    if spec.kv_capacity is not None:
        if spec.kv_capacity < 1:
            raise ValueError(f"--kv-capacity must be >= 1 token, got {spec.kv_capacity}")
        cfg.kv_capacity = spec.kv_capacity
    if spec.max_num_seqs is not None:
        if spec.max_num_seqs < 1:
            raise ValueError(f"--max-num-seqs must be >= 1, got {spec.max_num_seqs}")
        cfg.max_num_seqs = spec.max_num_seqs
    if spec.prefix_cache < 0:
        raise ValueError(f"--prefix-cache must be >= 0 tokens, got {spec.prefix_cache}")
    cfg.prefix_cache_tokens = spec.prefix_cache
    return cost, cfg


#: Figures of a run that come from the simulator itself, beside :func:`summarize`'s.
RUN_FIGURES = (
    "sim_time_s",
    "wall_s",
    "engine_steps",
    "policy_calls",
    "preemptions",
    "kv_peak_tokens",
    "mean_running",
    "rejected",
    "prompt_cached_pct",
)


def prompt_cached_pct(records: list[RequestRecord]) -> float | None:
    """Percent of the prompt tokens of admitted requests whose KV a prefix cache supplied
    (at each one's last admission); None when none was admitted."""
    return cached_prompt_pct(
        (r.request.prompt_len, r.cached_prompt_tokens)
        for r in records
        if r.cached_prompt_tokens is not None
    )


def row_figures() -> list[str]:
    """Every figure a summary row holds (what ``sweep --metrics`` may plot)."""
    return [*summarize([], slo=SLO()), *RUN_FIGURES]


@dataclass(slots=True)
class PlannedRun:
    """A spec made ready to run: names resolved and checked, deadlines assigned, nothing run.

    Split from the run so a caller can act on the final jobs first (``sim
    --save-trace`` writes them with their deadlines, and only once the policy,
    profile and predictor are known to exist).
    """

    spec: SimSpec
    jobs: list[Job]
    cost: LinearStepCost
    config: SimConfig
    policy: Policy
    predictor_name: str | None
    predictor: JobPredictor | None


def plan_spec(spec: SimSpec, jobs: list[Job] | None = None) -> PlannedRun:
    """Resolve a spec (profile, policy, predictor) and give its jobs their deadlines."""
    _check_prefix_options(spec)
    cost, cfg = sim_config(spec)
    policy = make_policy(spec.policy)
    pred_name = policy.default_predictor if spec.predictor == "policy" else spec.predictor
    predictor = make_job_predictor(pred_name, seed=spec.seed)
    if jobs is None:  # given jobs may carry prompts whatever the workload's name
        check_predictor_workload(pred_name, spec)
        jobs = build_jobs(spec)
    if spec.deadline_scale is not None:
        assign_deadlines(jobs, cost, spec.deadline_scale)
    return PlannedRun(spec, jobs, cost, cfg, policy, pred_name, predictor)


def _check_prefix_options(spec: SimSpec) -> None:
    """Refuse prefix options that would change nothing: each was run, and recorded as
    the run's setting."""
    from duetime.core.prefix_cache import DEFAULT_BLOCK_SIZE

    if 0 < spec.prefix_cache < DEFAULT_BLOCK_SIZE:
        raise ValueError(
            f"--prefix-cache {spec.prefix_cache} holds no {DEFAULT_BLOCK_SIZE}-token block: "
            f"give 0 (none) or >= {DEFAULT_BLOCK_SIZE}"
        )
    if spec.prefix_groups != 1 and not spec.shared_prefix:
        raise ValueError("--prefix-groups draws among --shared-prefix system prompts: give both")


def run_planned(plan: PlannedRun, progress: Any = None) -> tuple[SimResult, dict[str, Any]]:
    """Simulate a planned run; returns the simulator result and a flat summary row."""
    spec = plan.spec
    result = Simulator(plan.policy, plan.cost, plan.config, plan.predictor).run(
        plan.jobs, progress=progress
    )
    row: dict[str, Any] = {
        "policy": spec.policy,
        "rate_req_s": None if is_trace(spec) else spec.rate,
        "seed": spec.seed,
        "workload": Path(spec.workload).name if is_trace(spec) else spec.workload,
        "predictor": plan.predictor_name or "none",
    }
    row.update(summarize(result.records, slo=SLO()))
    run_figures = (
        result.sim_time,
        result.wall_s,
        result.engine_steps,
        result.policy_calls,
        result.preemptions,
        result.kv_peak,
        result.mean_running,
        result.counters.get("rejected", 0),
        prompt_cached_pct(result.records),
    )
    row.update(zip(RUN_FIGURES, run_figures, strict=True))
    return result, row


def run_spec(
    spec: SimSpec, jobs: list[Job] | None = None, progress: Any = None
) -> tuple[SimResult, dict[str, Any]]:
    """Run one spec; returns the simulator result and a flat summary row."""
    return run_planned(plan_spec(spec, jobs), progress)
