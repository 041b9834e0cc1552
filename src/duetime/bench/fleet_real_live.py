"""The live half of `duetime bench fleet-real`: its options, and what it asks of the real
fleet (start it, warm it up, read its cost models, count prompt tokens, send the trace).

The processes themselves are :mod:`.fleet_real_procs`'s; the run's order and why is
in :mod:`.fleet_real`.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from duetime.bench.fleet import CLASSES
from duetime.bench.fleet_real_compare import run_row
from duetime.bench.fleet_real_procs import FleetStartError, LocalProcesses, Started
from duetime.core.cost import CostModelError
from duetime.policies import make_policy
from duetime.routers import make_router
from duetime.server.gateway_profiles import cost_of
from duetime.server.load_report import to_record
from duetime.server.load_workload import LoadRequest, LoadWorkload
from duetime.server.loadgen import Bounds, LoadRun, Target, run_load, run_load_async
from duetime.server.ports import free_port
from duetime.sim.fleet import ReplicaSpec
from duetime.sim.fleet_build import replica

__all__ = [
    "WARMUP_ROUNDS",
    "FleetRealConfig",
    "check_external",
    "profiles",
    "prompt_tokens",
    "real_run",
    "served_model",
    "specs_of",
    "start_backends",
    "warm_up",
]


#: Warm-up rounds before a backend without a published cost model is an error.
WARMUP_ROUNDS = 4


@dataclass(slots=True)
class FleetRealConfig:
    """The fleet, the trace and the routers of one `bench fleet-real` run."""

    model: str = "gemma"
    replicas: int = 2
    threads_per_replica: int = 1
    routers: Sequence[str] = ("forecast", "lor", "round-robin")
    policy: str = "edf"
    rate: float | None = None  # None: load × the fleet's estimated capacity
    load: float = 0.8
    requests: int = 100
    workload: str = "synthetic"  # or sharegpt
    prompt_len: tuple[int, int] = (128, 128)
    output_len: tuple[int, int] = (64, 64)
    max_tokens: int = 256  # ShareGPT: the longest answer kept
    max_context: int = 1024
    class_mix: dict[str, float] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)
    max_num_seqs: int = 8
    max_batch_tokens: int = 256
    seed: int = 0
    start_timeout_s: float = 600.0
    drain_timeout_s: float = 600.0
    #: Backends this run does not start (vLLM, SGLang, another `duetime serve`): URL to
    #: the profile JSON `duetime profile --url` fitted for it, which prices it in the
    #: gateway and in the simulation alike. They join the fleet after the started ones.
    external: dict[str, str] = field(default_factory=dict)

    def external_profiles(self) -> dict[str, dict[str, Any]]:
        """Each external backend's profile, read and checked (a ValueError names the file)."""
        out: dict[str, dict[str, Any]] = {}
        for url, path in self.external.items():
            try:
                body = json.loads(Path(path).read_text())
                cost_of(body)
            except (OSError, ValueError, CostModelError) as e:
                # the cost model's own message may already say "not a usable profile"
                why = str(e).removeprefix(f"{path}: ")
                raise ValueError(f"--external {url}={path}: not a usable profile: {why}") from None
            out[url] = body
        return out

    def check(self) -> None:
        """Refuse settings no run can use, before any process starts."""
        self.external_profiles()
        if self.replicas < 1 or self.threads_per_replica < 1 or self.requests < 1:
            raise ValueError("--replicas, --threads-per-replica and --requests must be >= 1")
        if not self.routers:
            raise ValueError("--routers is empty: name at least one (`duetime routers`)")
        if len(set(self.routers)) != len(self.routers):
            raise ValueError(f"--routers names a router twice: {','.join(self.routers)}")
        for name in self.routers:
            make_router(name)  # an unknown name fails here, naming the known ones
        make_policy(self.policy)
        if self.workload not in ("synthetic", "sharegpt"):
            raise ValueError(f"--workload must be synthetic or sharegpt, got {self.workload!r}")
        if self.rate is not None and not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError(f"--rate must be a finite number of requests/s > 0, got {self.rate}")
        if not (math.isfinite(self.load) and 0 < self.load <= 2):
            raise ValueError(f"--load must be a share of capacity in (0, 2], got {self.load}")
        if self.max_batch_tokens < self.max_num_seqs:
            raise ValueError(
                f"--max-batch-tokens {self.max_batch_tokens} must be >= --max-num-seqs "
                f"{self.max_num_seqs}: every running sequence takes a token of each step"
            )
        if self.class_mix and not self.deadlines:
            factors = {name for name, _, _ in CLASSES}
            unknown = sorted(set(self.class_mix) - factors)
            if unknown:
                raise ValueError(
                    f"--class-mix names class {unknown[0]!r}, which has no default deadline "
                    f"(defaults: {', '.join(sorted(factors))}): give --deadline "
                    f"{unknown[0]}=SECONDS"
                )

    def trace(
        self, *, class_mix: Mapping[str, float], deadlines: Mapping[str, float]
    ) -> LoadWorkload:
        """The workload `duetime load` would send with these options."""
        synthetic = self.workload == "synthetic"
        return LoadWorkload(
            workload=self.workload,
            requests=self.requests,
            seed=self.seed,
            prompt_len=self.prompt_len,
            output_len=self.output_len,
            max_tokens=self.output_len[1] if synthetic else self.max_tokens,
            max_context=self.max_context,
            class_mix=dict(class_mix),
            deadlines=dict(deadlines),
        )


# --- the real fleet ----------------------------------------------------------------------
def start_backends(cfg: FleetRealConfig, procs: LocalProcesses) -> list[Started]:
    """``cfg.replicas`` `duetime serve` processes, all started before any is waited for
    (they load their models side by side), each healthy before this returns."""
    started: list[Started] = []
    ports: set[int] = set()
    for _ in range(cfg.replicas):
        port = free_port()
        while port in ports:  # the OS may hand a just-closed port out again
            port = free_port()
        ports.add(port)
        args = [
            *("serve", "--model", cfg.model, "--port", str(port)),
            *("--threads", str(cfg.threads_per_replica), "--policy", cfg.policy),
            *("--max-num-seqs", str(cfg.max_num_seqs)),  # given: no start-up sizing
            *("--max-batch-tokens", str(cfg.max_batch_tokens)),
            *("--max-waiting", str(max(256, cfg.requests))),  # the whole trace may queue
            *("--prefix-cache", "0", "--predictor", "none", "--log-level", "warning"),
        ]
        started.append(procs.start("backend", args, port, threads=cfg.threads_per_replica))
    for s in started:
        procs.wait_healthy(s, cfg.start_timeout_s)
    return started


def _start_gateway(
    cfg: FleetRealConfig, procs: LocalProcesses, urls: Sequence[str], router: str
) -> Started:
    port = free_port()
    args = ["gateway", "--port", str(port), "--router", router, "--seed", str(cfg.seed)]
    for url in urls:
        args += ["--backend", url]
    for url, path in cfg.external.items():
        args += ["--profile", f"{url}={path}"]
    args += ["--max-inflight", str(cfg.requests), "--max-queue", str(max(1024, cfg.requests))]
    args += ["--log-level", "warning"]
    gw = procs.start("gateway", args, port)
    procs.wait_healthy(gw, cfg.start_timeout_s, ready=_every_backend_up)
    return gw


def _every_backend_up(health: httpx.Response) -> bool:
    """Whether the gateway's ``/health`` has every backend up: a run that began before
    its first probes would go to whichever backend it had seen first."""
    try:
        backends = health.json()["backends"]
        return bool(backends) and all(b["up"] for b in backends)
    except (ValueError, KeyError, TypeError):
        return False


def _ask(client: httpx.Client, url: str, path: str, body: Any = None) -> Any:
    """``GET`` (or, with ``body``, ``POST``) one of a backend's routes; its JSON answer.
    Anything but a 200 with JSON is a :class:`FleetStartError` naming the backend."""
    method = "GET" if body is None else "POST"
    try:
        r = client.request(method, url + path, json=body)
        r.raise_for_status()
        return r.json()
    except (httpx.HTTPError, ValueError) as e:
        raise FleetStartError(f"backend {url}: {method} {path} failed ({e})") from None


def served_model(client: httpx.Client, url: str) -> tuple[str, int]:
    """The model id the backend serves and its longest prompt + answer."""
    try:
        model = _ask(client, url, "/v1/models")["data"][0]
        return str(model["id"]), int(model["max_model_len"])
    except (KeyError, IndexError, TypeError, ValueError):
        raise FleetStartError(f"backend {url}: /v1/models lists no model") from None


def check_external(client: httpx.Client, urls: Sequence[str], model: str, longest: int) -> None:
    """Every external backend serves ``model`` (the gateway routes by the model's name) and
    takes the trace's ``longest`` prompt + answer, or a :class:`FleetStartError` names it."""
    for url in urls:
        try:
            listed = {str(m["id"]): m for m in _ask(client, url, "/v1/models")["data"]}
        except (KeyError, TypeError) as e:
            raise FleetStartError(f"backend {url}: /v1/models is malformed ({e})") from None
        if model not in listed:
            raise FleetStartError(
                f"backend {url} serves {sorted(listed)}, not {model!r}, the model the started "
                f"backends serve: serve it under that name (vLLM: --served-model-name {model})"
            )
        theirs = listed[model].get("max_model_len")
        if isinstance(theirs, int) and theirs < longest:
            raise FleetStartError(
                f"backend {url} takes {theirs} tokens of prompt + answer, the trace's longest "
                f"request {longest}: give it --max-model-len {longest} or more"
            )


def prompt_tokens(client: httpx.Client, url: str, texts: Sequence[str]) -> dict[str, int]:
    """Each prompt's tokens as the backend counts a completion's prompt (BOS included)."""
    return {
        text: int(_ask(client, url, "/tokenize", {"prompt": text})["count"])
        for text in dict.fromkeys(texts)
    }


def warm_up(cfg: FleetRealConfig, urls: Sequence[str], model: str, round_: int) -> None:
    """A burst of mixed lengths straight to every backend, all at once."""
    synthetic = cfg.workload == "synthetic"
    hi_out = cfg.output_len[1] if synthetic else min(cfg.max_tokens, 64)
    hi_prompt = cfg.prompt_len[1] if synthetic else 64
    burst = LoadWorkload(
        workload="synthetic",
        requests=2 * cfg.max_num_seqs,
        seed=cfg.seed + 1000 + round_,
        prompt_len=(max(1, hi_prompt // 4), hi_prompt),
        output_len=(max(1, hi_out // 4), hi_out),
        max_tokens=hi_out,
        max_context=cfg.max_context,
    ).build(math.inf)
    bounds = Bounds(max_requests=len(burst), duration_s=math.inf, drain_timeout_s=600.0)

    async def all_backends() -> list[LoadRun]:
        return await asyncio.gather(
            *(
                run_load_async(burst, Target(base=url, model=model, ignore_eos=True), bounds)
                for url in urls
            )
        )

    for url, run in zip(urls, asyncio.run(all_backends()), strict=True):
        bad = [o for o in run.outcomes if o.status != "ok"]
        if bad:
            raise FleetStartError(
                f"backend {url}: {len(bad)} of {len(run.outcomes)} warm-up requests failed "
                f"({bad[0].status}: {bad[0].error or bad[0].http_status})"
            )


def profiles(
    client: httpx.Client,
    urls: Sequence[str],
    where: Path,
    tag: str,
    given: Mapping[str, dict[str, Any]],
) -> list[dict[str, Any]] | None:
    """Every backend's published profile, or its ``given`` one, also written to ``where``
    (None: one has none yet)."""
    bodies = []
    for i, url in enumerate(urls):
        if url in given:
            (where / f"{tag}-{i}.json").write_text(json.dumps(given[url]))
            bodies.append(given[url])
            continue
        try:
            r = client.get(url + "/v1/profile")
            if r.status_code == 503:
                return None  # no model yet: too few steps served
            r.raise_for_status()
            body = r.json()
        except (httpx.HTTPError, ValueError) as e:
            raise FleetStartError(f"backend {url}: GET /v1/profile failed ({e})") from None
        (where / f"{tag}-{i}.json").write_text(json.dumps(body))
        bodies.append(body)
    return bodies


def specs_of(urls: Sequence[str], where: Path, tag: str) -> list[ReplicaSpec]:
    """Simulated replicas from the profiles :func:`profiles` wrote (read as `sim` reads one)."""
    return [replica(str(where / f"{tag}-{i}.json"), name=url) for i, url in enumerate(urls)]


def real_run(
    cfg: FleetRealConfig,
    procs: LocalProcesses,
    urls: Sequence[str],
    router: str,
    model: str,
    plan: Sequence[LoadRequest],
    progress: Callable[[int, int], None],
) -> dict[str, Any]:
    """The trace through a fresh gateway routing with ``router``; the gateway ended after."""
    gw = _start_gateway(cfg, procs, urls, router)
    try:
        bounds = Bounds(
            max_requests=len(plan),
            duration_s=math.inf,
            drain_timeout_s=cfg.drain_timeout_s,
            request_timeout_s=cfg.drain_timeout_s,
            concurrency=max(256, len(plan)),
        )
        run = run_load(plan, Target(base=gw.url, model=model, ignore_eos=True), bounds, progress)
    finally:
        procs.stop(gw)
    sent = run.sent
    records = [to_record(o) for o in sent]
    rejected = [o for o in sent if o.status == "rejected"]
    row = run_row(records, len(rejected))
    # a 429 a backend gave carries the gateway's X-Duetime-Backend; the gateway's own not
    row["refused_by_backends"] = sum(o.backend is not None for o in rejected)
    row["errors"] = sum(o.status == "error" for o in sent)
    errors = [o.error for o in sent if o.error]
    row["first_error"] = errors[0] if errors else None
    where = {url: i for i, url in enumerate(urls)}
    routes = {o.request.rid: where[o.backend] for o in sent if o.backend in where}
    return {"row": row, "records": records, "routes": routes}
