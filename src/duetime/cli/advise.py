"""Advice from the analytic models (`duetime advise ...`)."""

from __future__ import annotations

from typing import Annotated

import typer

from duetime.cli.common import (
    JsonOpt,
    _user_errors,
    advise_app,
    out,
)


@advise_app.command("deferred-prefill")
def advise_deferred_prefill(
    capacity: Annotated[int, typer.Option(min=1, help="Batch capacity C (requests).")],
    mean_output: Annotated[
        float, typer.Option(help="Mean output tokens per request (the prefill's included).")
    ],
    prompt_len: Annotated[
        float, typer.Option(help="Mean prompt tokens d0 (default: the paper's 285).")
    ] = 285.0,
    profile: Annotated[str, typer.Option(help="Shipped profile name or JSON path.")] = (
        "a100-llama2-7b"
    ),
    json_path: JsonOpt = None,
) -> None:
    """K* for deferred prefill (Mohanty et al. 2025): ρ(K*) and the gain over K = 1."""
    from duetime.analysis.deferred_prefill import DeferredPrefillModel, advise
    from duetime.metrics import write_json
    from duetime.sim.profiles import load_profile

    with _user_errors():
        cost, _ = load_profile(profile)
        model = DeferredPrefillModel.from_cost(cost, capacity, mean_output, prompt_len)
        adv = advise(model)
    out.print(
        f"c_p = {model.c_p * 1e3:.2f} ms, t_p·d0/N = {model.prefill_per_prompt * 1e3:.2f} ms, "
        f"c_d = {model.c_d * 1e3:.2f} ms, t_d = {model.t_d * 1e6:.1f} us, "
        f"1/α = {1 / model.alpha:.1f} decode steps, C = {capacity}"
    )
    out.print(
        f"K* = {adv['k_star']}: ρ(K*) = {adv['throughput_k_star_req_s']:.3f} req/s, "
        f"{adv['gain_vs_k1_pct']:+.2f} % vs K = 1 ({adv['throughput_k1_req_s']:.3f} req/s)"
    )
    out.print(
        f"approximation (Prop. 1): K* = {adv['k_star_approx']}, "
        f"{adv['gain_vs_k1_approx_pct']:+.2f} % vs K = 1"
    )
    if json_path is not None:
        write_json(json_path, adv)
