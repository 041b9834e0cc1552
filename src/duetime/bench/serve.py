"""`duetime bench serve`: policies side by side behind the real server, and the server's overhead.

Part 1 serves the same open-loop workload (ShareGPT prompts, Poisson arrivals,
ignore-EOS lengths, a deadline per class) through `duetime serve` once per
policy, each on a fresh engine over the same loaded model, and reports
deadline hit rate, goodput and latency percentiles from the client's side
(`duetime load`'s figures).

Part 2 measures what HTTP costs: a model whose step does no work (it returns
constant logits, so only scheduling, the engine thread, tokenization, JSON and
SSE remain) is driven (a) closed-loop by 16 clients for requests/s and
(b) one request at a time, where the added latency per request is the client's
e2e minus the engine's own e2e for the same request (`duetime.e2e_ms`).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import torch

from duetime.engine.gemma3 import Gemma3
from duetime.engine.kv_cache import KVCache
from duetime.server.app import create_app
from duetime.server.build import ServeOptions, build_state, load_served_model
from duetime.server.codec import Codec
from duetime.server.load_report import summarize_run
from duetime.server.load_workload import LoadWorkload
from duetime.server.loadgen import Bounds, Target, run_load
from duetime.server.threaded import serve_in_thread

__all__ = ["NoopModel", "ServeBenchConfig", "run_serve_bench"]

DEFAULT_POLICIES = ("fcfs", "edf", "timebill", "timelyllm")


class NoopModel:
    """A stand-in for :class:`Gemma3` whose step computes nothing (server overhead only)."""

    def __init__(self, model: Gemma3) -> None:
        self.config = model.config
        self._kv = model.new_kv_cache
        self._logits: torch.Tensor | None = None

    def new_kv_cache(self, max_tokens: int | None = None) -> KVCache:
        return self._kv(max_tokens)

    def step(self, chunks: Sequence[Any], kv: KVCache, **_: Any) -> torch.Tensor:
        n = len(chunks)
        if self._logits is None or self._logits.shape[0] < n:
            self._logits = torch.zeros(max(n, 64), self.config.vocab_size)
        return self._logits[:n]

    def greedy_step(self, chunks: Sequence[Any], kv: KVCache) -> torch.Tensor:
        """The token :meth:`step`'s logits' arg-max picks (0) for each chunk."""
        return torch.zeros(len(chunks), dtype=torch.int64)


@dataclass(slots=True)
class ServeBenchConfig:
    model: str = "gemma"
    policies: Sequence[str] = DEFAULT_POLICIES
    requests: int = 24
    rate: float = 0.5
    max_tokens: int = 32
    max_prompt: int = 256
    deadlines: dict[str, float] | None = None  # per class, seconds
    class_mix: dict[str, float] | None = None
    seed: int = 0
    overhead_requests: int = 200
    kv_capacity: int = 16_384
    max_num_seqs: int = 16


def _policy_run(
    cfg: ServeBenchConfig, model: Gemma3, codec: Codec, name: str, policy: str
) -> dict[str, Any]:
    options = ServeOptions(
        model=cfg.model,
        policy=policy,
        predictor=None,
        kv_capacity=cfg.kv_capacity,
        max_num_seqs=cfg.max_num_seqs,
    )
    state = build_state(options, model, codec, name)
    workload = LoadWorkload(
        workload="sharegpt",
        requests=4 * cfg.requests,  # room to drop the prompts the model cannot take
        seed=cfg.seed,
        max_tokens=cfg.max_tokens,
        max_context=cfg.max_prompt + cfg.max_tokens,
        class_mix=dict(cfg.class_mix or {}),
        deadlines=dict(cfg.deadlines or {}),
    )
    # ShareGPT's lengths are Gemma tokens; a model with another tokenizer (the tiny
    # one's bytes) counts some prompts past its context, which would be 400s: the first
    # ``requests`` that fit keep the arrival times of the first ``requests`` built
    room = state.config.max_context
    built = workload.build(cfg.rate)
    fits = [r for r in built if len(codec.encode(r.prompt)) + r.max_tokens <= room]
    reqs = [
        dataclasses.replace(r, rid=k, arrival=at.arrival)
        for k, (r, at) in enumerate(zip(fits[: cfg.requests], built, strict=False))
    ]
    bounds = Bounds(max_requests=cfg.requests, duration_s=3600, drain_timeout_s=600)
    with serve_in_thread(create_app(state)) as url:
        run = run_load(reqs, Target(base=url, model=name, ignore_eos=True), bounds)
    row = summarize_run(run)
    row["policy"] = policy
    return row


def _overhead(model: Gemma3, codec: Codec, name: str, n: int) -> dict[str, Any]:
    noop = NoopModel(model)
    options = ServeOptions(model="noop", predictor=None, kv_capacity=65_536, max_num_seqs=64)
    state = build_state(options, noop, codec, name)  # type: ignore[arg-type]
    body = {"model": name, "prompt": "Hello", "max_tokens": 8, "ignore_eos": True}
    added: list[float] = []
    direct: list[float] = []
    gateway: list[float] = []
    with (
        serve_in_thread(create_app(state)) as url,
        httpx.Client(base_url=url) as client,
        _gateway_client(url) as via,
    ):
        for _ in range(10):  # warm-up
            client.post("/v1/completions", json=body).raise_for_status()
            via.post("/v1/completions", json=body).raise_for_status()
        for _ in range(n):  # alternating: both paths see the same moments of the server
            t0 = time.perf_counter()
            r = client.post("/v1/completions", json=body)
            e2e = time.perf_counter() - t0
            r.raise_for_status()
            direct.append(e2e)
            added.append(e2e - r.json()["duetime"]["e2e_ms"] / 1000.0)
            t0 = time.perf_counter()
            via.post("/v1/completions", json=body).raise_for_status()
            gateway.append(time.perf_counter() - t0)
        import asyncio

        async def closed_loop(clients: int, seconds: float) -> int:
            done = 0
            stop = time.perf_counter() + seconds
            async with httpx.AsyncClient(base_url=url) as ac:

                async def one() -> None:
                    nonlocal done
                    while time.perf_counter() < stop:
                        (await ac.post("/v1/completions", json=body)).raise_for_status()
                        done += 1

                await asyncio.gather(*(one() for _ in range(clients)))
            return done

        seconds = 5.0
        done = asyncio.run(closed_loop(16, seconds))
    added.sort()
    return {
        "overhead_requests": n,
        "added_latency_p50_ms": 1000 * statistics.median(added),
        "added_latency_p90_ms": 1000 * added[int(0.9 * (len(added) - 1))],
        "noop_req_s": done / seconds,
        "noop_tokens_per_request": 8,
        # `duetime gateway` (default router, scraping on) in front of the same server:
        # its median e2e less the direct one's, the requests alternating in one run
        "gateway_added_latency_p50_ms": 1000
        * (statistics.median(gateway) - statistics.median(direct)),
    }


@contextmanager
def _gateway_client(url: str) -> Iterator[httpx.Client]:
    """A client of a `duetime gateway` (default router, scraping on) in front of ``url``,
    once the gateway has seen its backend up."""
    from duetime.server.gateway import GatewayConfig, create_gateway_app

    config = GatewayConfig(health_interval_s=0.5)
    with (
        serve_in_thread(create_gateway_app([url], config)) as gw,
        httpx.Client(base_url=gw, trust_env=False) as client,
    ):
        deadline = time.monotonic() + 30.0
        while not any(b["up"] for b in client.get("/health").json()["backends"]):  # probed
            if time.monotonic() > deadline:
                raise RuntimeError("the gateway never saw its backend up")
            time.sleep(0.05)
        yield client


def check_config(cfg: ServeBenchConfig) -> None:
    """Refuse what would fail part-way (or run nothing), before the model loads.

    Every policy is built once here: an unknown name last in ``--policies`` used
    to fail only after the ones before it had been served.
    """
    from duetime.bench.engine_fit import check_model_spec
    from duetime.policies import make_policy

    check_model_spec(cfg.model)
    if not cfg.policies:
        raise ValueError("--policies is empty: name at least one policy, e.g. fcfs,edf")
    for name in cfg.policies:
        try:
            policy = make_policy(name)
        except ValueError as e:
            raise ValueError(f"--policies: {e}") from None
        if getattr(policy, "needs_prediction", False):
            raise ValueError(
                f"--policies {name}: {name} orders requests by their predicted length, and "
                "bench serve serves every policy without a length predictor; serve it alone "
                f"with `duetime serve --policy {name} --predictor learned`"
            )


def run_serve_bench(
    cfg: ServeBenchConfig, progress: Callable[[int, int], None] | None = None
) -> dict[str, Any]:
    check_config(cfg)
    options = ServeOptions(model=cfg.model, predictor=None)
    model, codec, name = load_served_model(options)
    total = len(cfg.policies) + 1
    rows = []
    for i, policy in enumerate(cfg.policies):
        rows.append(_policy_run(cfg, model, codec, name, policy))
        if progress:
            progress(i + 1, total)
    overhead = _overhead(model, codec, name, cfg.overhead_requests)
    if progress:
        progress(total, total)
    return {
        "model": name,
        "requests": cfg.requests,
        "rate_req_s": cfg.rate,
        "max_tokens": cfg.max_tokens,
        "deadlines_s": cfg.deadlines,
        "class_mix": cfg.class_mix,
        "policies": rows,
        "overhead": overhead,
    }
