"""`duetime gateway`: deadline-aware admission and routing over OpenAI-compatible backends,
by the routers `duetime sim --router` runs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from duetime.cli.common import (
    HeaderTimeoutOpt,
    HostOpt,
    LogLevelOpt,
    PortOpt,
    ShutdownTimeoutOpt,
    _user_errors,
    app,
    err,
)

_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def _check_backends(backends: list[str], allow_remote: bool) -> list[str]:
    if not backends:
        raise ValueError("give at least one --backend URL (e.g. http://127.0.0.1:8001)")
    import httpx

    from duetime.server.load_target import base_url

    urls: list[str] = []
    for raw in backends:
        url = base_url(raw, option="--backend")  # as `duetime load --url` reads one
        host = httpx.URL(url).host
        if host not in _LOOPBACK and not host.startswith("127.") and not allow_remote:
            raise ValueError(
                f"--backend {raw!r} is not on loopback; pass --allow-remote to use remote backends"
            )
        if url in urls:
            raise ValueError(f"--backend {raw!r} is given twice")
        urls.append(url)
    return urls


def _check_not_itself(urls: list[str], host: str, port: int) -> None:
    """Refuse a backend at the gateway's own address: it routed requests to itself, each
    relayed once more until the client's timeout (counted ``ok`` twice)."""
    import httpx

    if port == 0:  # any free port: no backend can name it yet
        return
    wildcard = host in ("0.0.0.0", "::", "")
    for url in urls:
        u = httpx.URL(url)
        same_port = (u.port or (443 if u.scheme == "https" else 80)) == port
        on_loopback = u.host in _LOOPBACK or u.host.startswith("127.")
        if same_port and (u.host == host or (on_loopback and (wildcard or host in _LOOPBACK))):
            raise ValueError(
                f"--backend {url} is this gateway's own address (--host {host} --port {port}): "
                "it would send requests to itself"
            )


def _seconds(v: object) -> bool:
    """A JSON number of seconds: not a string, not a bool, not NaN / Infinity, > 0."""
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _load_profiles(items: list[str], urls: list[str]) -> dict[str, dict[str, Any]]:
    """``URL=path.json``: a step-cost model profile (``duetime profile --url`` writes one,
    with ``coefficients``) that prices that backend, or ``ttft_s`` / ``tpot_s`` seeds
    (seconds) for its moving averages."""
    from duetime.core.cost import CostModelError
    from duetime.server.gateway_profiles import cost_of

    out: dict[str, dict[str, Any]] = {}
    for item in items:
        url, sep, path = item.partition("=")
        url = url.rstrip("/")
        if not sep or url not in urls:
            raise ValueError(f"--profile {item!r} must be URL=path with URL one of the backends")
        data = json.loads(Path(path).read_text())
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a profile must be a JSON object")
        if "coefficients" in data:
            try:
                cost_of(data)
            except CostModelError as e:
                raise ValueError(f"{path}: {e}") from None
            out[url] = data
            continue
        seed = {k: data[k] for k in ("ttft_s", "tpot_s") if k in data}
        if not seed or not all(_seconds(v) for v in seed.values()):
            raise ValueError(
                f"{path}: needs 'coefficients' (a cost-model profile) or ttft_s and/or tpot_s "
                "as finite numbers > 0 (seconds)"
            )
        out[url] = {k: float(v) for k, v in seed.items()}
    return out


@app.command()
def gateway(
    backend: Annotated[
        list[str], typer.Option(help="A backend's base URL (repeat): http://127.0.0.1:8001.")
    ] = [],  # noqa: B006 - typer needs a literal default
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    max_inflight: Annotated[int, typer.Option(min=1, help="Requests in flight per backend.")] = 8,
    max_queue: Annotated[int, typer.Option(min=1, help="Waiting requests before 429.")] = 1024,
    health_interval: Annotated[
        float, typer.Option(min=0.05, help="Seconds between health probes.")
    ] = 0.5,
    down_after: Annotated[
        int,
        typer.Option(
            min=1,
            help="Health probes in a row that time out (1 s each) before a backend is down; "
            "a refused connection or an error status is down at once.",
        ),
    ] = 3,
    request_timeout: Annotated[float, typer.Option(min=1.0, help="Seconds per request.")] = 600.0,
    suspect_after: Annotated[
        int,
        typer.Option(min=0, help="Read timeouts in a row that make a backend suspect (0: never)."),
    ] = 3,
    suspect_cooldown: Annotated[
        float,
        typer.Option(min=0.0, help="Seconds a suspect backend gets only what no other can take."),
    ] = 30.0,
    router: Annotated[
        str,
        typer.Option(
            help="Router choosing each request's backend (`duetime routers` lists them; the "
            "ones `duetime sim --router` runs). forecast: earliest forecast finish, and a 429 "
            "for a deadline no backend's forecast meets."
        ),
    ] = "forecast",
    seed: Annotated[int, typer.Option(help="Seed of the router (random, power-of-two).")] = 0,
    scrape_interval_ms: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Milliseconds between reads of each backend's Prometheus /metrics (duetime "
            "serve's or vLLM's running, waiting, KV use, prefix-cache hits; the router sees "
            "them plus what the gateway sent and saw end since). 0: off, for backends of "
            "another kind. A /metrics of neither format is an error at start.",
        ),
    ] = 250.0,
    scrape_max_age_ms: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="A scrape older than this is not trusted: the router sees the gateway's own "
            "counts for that backend, and /health reports its metrics stale.",
        ),
    ] = 1000.0,
    profile: Annotated[
        list[str],
        typer.Option(
            help="URL=path.json (repeatable): a cost-model profile for a backend that "
            "publishes none (`duetime profile --url` writes one), or ttft_s/tpot_s seeds."
        ),
    ] = [],  # noqa: B006
    profile_interval: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="Seconds between reads of each duetime serve backend's published step-cost "
            "model (GET /v1/profile; shown in /health, prices its requests until it has "
            "answered one). 0: off.",
        ),
    ] = 10.0,
    allow_remote: Annotated[bool, typer.Option(help="Allow backends off loopback.")] = False,
    shutdown_timeout: ShutdownTimeoutOpt = 30,
    header_timeout: HeaderTimeoutOpt = 30.0,
    log_level: LogLevelOpt = "info",
) -> None:
    """Route OpenAI requests over several backends with a fleet router (docs/gateway.md).

    Deadlines: the body's deadline_ms, or the headers x-deadline-ms, x-slo-ttft-ms and
    x-slo-tpot-ms (ms; the schedule ends at ttft + tpot * max_tokens). A refusal is 429
    with Retry-After; an answer names its backend and forecast in X-Duetime-Backend and
    X-Duetime-Forecast-Ms. Each backend's /metrics is read every --scrape-interval-ms.
    """

    from duetime.server.gateway import GatewayConfig, create_gateway_app
    from duetime.server.gateway_scrape import check_metrics
    from duetime.server.ports import listening_socket
    from duetime.server.threaded import run_server

    with _user_errors():
        urls = _check_backends(backend, allow_remote)
        if seed < 0:  # numpy's "expected non-negative integer" named no option
            raise ValueError(f"--seed must be >= 0, got {seed}")
        _check_not_itself(urls, host, port)
        if 0 < scrape_max_age_ms < scrape_interval_ms:
            raise ValueError(
                f"--scrape-max-age-ms {scrape_max_age_ms:g} is below --scrape-interval-ms "
                f"{scrape_interval_ms:g}: every scrape would be stale before the next"
            )
        try:
            profiles = _load_profiles(profile, urls)
        except json.JSONDecodeError as e:
            raise ValueError(f"--profile: not valid JSON: {e.msg}") from None
        config = GatewayConfig(
            max_inflight=max_inflight,
            max_queue=max_queue,
            health_interval_s=health_interval,
            down_after_probe_timeouts=down_after,
            request_timeout_s=request_timeout,
            suspect_after_timeouts=suspect_after,
            suspect_cooldown_s=suspect_cooldown,
            router=router,
            router_seed=seed,
            scrape_interval_s=scrape_interval_ms / 1000.0,
            scrape_max_age_s=scrape_max_age_ms / 1000.0,
            profile_interval_s=profile_interval,
        )
        # the port once the options are checked, before the backends are asked anything
        sock = listening_socket(host, port)
        port = sock.getsockname()[1]
        if scrape_interval_ms > 0:  # an unreadable /metrics stops here, naming its URL
            for warning in check_metrics(urls):
                err.print(f"warning: {warning}", highlight=False)
        gw_app = create_gateway_app(urls, config, profiles)
    err.print(
        f"duetime gateway on http://{host}:{port}/v1 over {len(urls)} backend(s): "
        + ", ".join(urls)
        + f"; router {router}",
        highlight=False,
    )
    run_server(
        gw_app,
        sock=sock,
        log_level=log_level,
        shutdown_timeout_s=shutdown_timeout,
        header_timeout_s=header_timeout,
    )
