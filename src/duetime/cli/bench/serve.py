"""`duetime bench serve`: the policies side by side behind `duetime serve`, and its overhead."""

from __future__ import annotations

from typing import Annotated

import typer

from duetime.cli.bench.options import PoliciesOpt, SeedOpt, ServedModelOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.common import JsonOpt, MaxTokensOpt, _progress, _user_errors, bench_app, out
from duetime.comma_lists import comma_list


@bench_app.command("serve")
def bench_serve(
    model: ServedModelOpt = "gemma",
    policies: PoliciesOpt = "fcfs,edf,timebill,timelyllm",
    requests: Annotated[int, typer.Option(min=1, help="Requests per policy.")] = 24,
    rate: Annotated[float, typer.Option(min=0.0, help="Poisson arrival rate, req/s.")] = 0.5,
    max_tokens: MaxTokensOpt = 32,
    deadline: Annotated[
        list[str] | None, typer.Option(help="Per-class deadline CLASS=SECONDS (repeatable).")
    ] = None,
    class_mix: Annotated[str | None, typer.Option(help="CLASS=weight,... mix.")] = (
        "interactive=0.5,batch=0.5"
    ),
    overhead_requests: Annotated[
        int, typer.Option(min=10, help="Sequential no-op requests.")
    ] = 200,
    seed: SeedOpt = 0,
    json_path: JsonOpt = None,
) -> None:
    """Policies side by side behind `duetime serve` (same load), plus the server's own overhead.

    Each request asks (ignore-EOS) for its recorded answer's length."""
    from duetime.bench.serve import ServeBenchConfig, run_serve_bench
    from duetime.metrics import render_table
    from duetime.server.load_workload import parse_deadlines, parse_mix

    with _user_errors():
        cfg = ServeBenchConfig(
            model=model,
            policies=list(dict.fromkeys(comma_list(policies))),  # fcfs,fcfs: served once
            requests=requests,
            rate=rate,
            max_tokens=max_tokens,
            deadlines=parse_deadlines(deadline or ["interactive=6", "batch=60"]),
            class_mix=parse_mix(class_mix),
            seed=seed,
            overhead_requests=overhead_requests,
        )
        prog, cb = _progress(len(cfg.policies) + 1, "serving")
        with prog:
            fig = run_serve_bench(cfg, cb)
    keys = [
        "ok",
        "rejected",
        "errors",
        "deadline_hit_rate",
        "goodput_req_s",
        "throughput_tok_s",
        "ttft_p50_s",
        "e2e_p50_s",
        "e2e_p90_s",
    ]
    rows = [(r["policy"], r) for r in fig["policies"]]
    out.print(
        render_table(rows, keys=keys, title=f"{fig['model']}: {requests} requests at {rate}/s")
    )
    o = fig["overhead"]
    out.print(
        f"server overhead (no-op model): added latency p50 {o['added_latency_p50_ms']:.2f} ms, "
        f"p90 {o['added_latency_p90_ms']:.2f} ms (target p50 <= 2 ms); through `duetime "
        f"gateway` p50 +{o['gateway_added_latency_p50_ms']:.2f} ms more (target <= 2 ms); "
        f"{o['noop_req_s']:.0f} req/s with 16 closed-loop clients, 8 tokens each"
    )
    save_figures(fig, json_path=json_path)
