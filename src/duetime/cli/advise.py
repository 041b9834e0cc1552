"""Advice from the analytic models (`duetime advise ...`)."""

from __future__ import annotations

import math
from typing import Annotated

import typer

from duetime.cli.common import (
    AlaDataOpt,
    JsonOpt,
    ProfileOpt,
    _user_errors,
    advise_app,
    out,
)
from duetime.predict.ala_limits import MAX_BATCH, MAX_TOKENS


@advise_app.command("deferred-prefill")
def advise_deferred_prefill(
    capacity: Annotated[
        int,
        typer.Option(
            min=1,
            max=4096,
            help="Batch capacity C (requests; the solve grows as C³: ~1 min at 4096).",
        ),
    ],
    mean_output: Annotated[
        float,
        typer.Option(help="Mean output tokens per request (the prefill's included; 2 to 1e7)."),
    ],
    prompt_len: Annotated[
        float, typer.Option(help="Mean prompt tokens d0, up to 1e7 (default: the paper's 285).")
    ] = 285.0,
    profile: ProfileOpt = "a100-llama2-7b",
    json_path: JsonOpt = None,
) -> None:
    """K* for deferred prefill, ρ(K*) and the gain over K = 1 (Theorem 1 of Mohanty and
    co-authors, 2025: docs/deferred-prefill.md)."""
    from duetime.analysis.deferred_prefill import DeferredPrefillModel, advise
    from duetime.metrics import write_json
    from duetime.sim.profiles import load_profile

    with _user_errors():
        cost, _ = load_profile(profile)
        model = DeferredPrefillModel.from_cost(cost, capacity, mean_output, prompt_len)
        adv = advise(model)
        if json_path is not None:  # before the lines: a closed stdout must not lose the file
            inputs = {"mean_output_tokens": mean_output, "prompt_len_tokens": prompt_len}
            write_json(json_path, {**inputs, "profile": profile, **adv})
    out.print(
        f"c_p = {model.c_p * 1e3:.2f} ms, t_p·d0/N = {model.prefill_per_prompt * 1e3:.2f} ms, "
        f"c_d = {model.c_d * 1e3:.2f} ms, t_d = {model.t_d * 1e6:.1f} us, "
        f"1/α = {1 / model.alpha:.1f} decode steps, C = {capacity}"
    )
    out.print(
        f"exact (Theorem 1): K* = {adv['k_star']}, "
        f"ρ(K*) = {adv['throughput_k_star_req_s']:.3f} req/s, "
        + _gain(adv["gain_vs_k1_pct"], adv["throughput_k1_req_s"])
    )
    if adv["k_star_approx"] is None:
        out.print(f"approximation (Prop. 1): undefined at C = {capacity} (it needs a K < C)")
        return
    # Two gains for Prop. 1's K*: what the approximation predicts, and what Theorem 1
    # (the exact model) gives at that K; the first line's gain is Theorem 1's at its K*.
    out.print(
        f"approximation (Prop. 1): K* = {adv['k_star_approx']}, predicts "
        f"ρ(K*) = {adv['prop1_throughput_k_star_approx_req_s']:.3f} req/s, "
        + _gain(adv["prop1_gain_pct"], adv["prop1_throughput_k1_req_s"])
    )
    out.print(
        f"Theorem 1 at Prop. 1's K* = {adv['k_star_approx']}: "
        f"ρ = {adv['theorem1_throughput_at_k_star_approx_req_s']:.3f} req/s, "
        + _gain(adv["theorem1_gain_at_k_star_approx_pct"], adv["throughput_k1_req_s"], at=False)
    )


def _gain(pct: float, base_req_s: float, *, at: bool = True) -> str:
    """``+x % vs K = 1 (ρ(1) req/s)``; where ρ(1) is 0 there is no gain to report (a
    percentage of nothing), and the words say so instead of printing nan."""
    if not (math.isfinite(pct) and base_req_s > 0):
        return "no gain to report (ρ at K = 1 is 0)"
    return f"{pct:+.2f} % vs K = 1" + (f" ({base_req_s:.3f} req/s)" if at else "")


@advise_app.command("batch")
def advise_batch_size(
    input_len: Annotated[
        int, typer.Option("--input-len", min=1, max=MAX_TOKENS, help="ii: prompt tokens.")
    ],
    output_len: Annotated[
        int, typer.Option("--output-len", min=1, max=MAX_TOKENS, help="oo: output tokens.")
    ],
    deadline: Annotated[float, typer.Option(help="Seconds in which the whole batch must finish.")],
    config: Annotated[
        str, typer.Option(help="Hardware/software configuration in the ALA data.")
    ] = "sim-a100-llama2-7b",
    max_batch: Annotated[
        int, typer.Option(min=1, max=MAX_BATCH, help="Largest batch to consider (~1 s a 1,000).")
    ] = 256,
    data: AlaDataOpt = None,
    json_path: JsonOpt = None,
) -> None:
    """Largest batch whose ALA-predicted wall time meets a deadline (with its interval)."""
    from dataclasses import asdict

    from rich.markup import escape
    from rich.table import Table

    from duetime.metrics import write_json
    from duetime.predict.ala_advise import advise_batch
    from duetime.predict.ala_data import config_data
    from duetime.predict.ala_model import AlaPredictor

    with _user_errors():
        pred = AlaPredictor(config_data(config, data))
        adv = advise_batch(pred, input_len, output_len, deadline, max_batch)
        if json_path is not None:  # before the table: a closed stdout must not lose the file
            payload = {k: v for k, v in adv.items() if k not in ("safe", "expected", "options")}
            payload["config"] = config
            payload["coverage"] = pred.coverage
            payload["options"] = [asdict(o) for o in adv["options"]]  # type: ignore[attr-defined]
            payload["heldout_median_err_pct"] = pred.cv_median_err_pct
            write_json(json_path, payload)
    title = f"{escape(config)}: ii={input_len} oo={output_len}, deadline {deadline:g} s"
    table = Table(title=title)
    interval = f"{pred.coverage * 100:g} % interval"  # as predict throughput writes it
    for col in ("bb", "tok/s", interval, "wall s", "wall s (pessimistic)", "confidence"):
        table.add_column(col, justify="right")
    shown = {1 << k for k in range(max_batch.bit_length())} | {adv["bb_safe"], adv["bb_expected"]}
    for o in adv["options"]:  # type: ignore[attr-defined]
        if o.bb in shown:
            table.add_row(
                f"[bold]{o.bb}[/]" if o.bb in (adv["bb_safe"], adv["bb_expected"]) else str(o.bb),
                f"{o.thpt_tok_s:,.1f}",
                escape(f"[{o.thpt_lo_tok_s:,.1f}, {o.thpt_hi_tok_s:,.1f}]"),
                f"{o.wall_s:.2f}",
                # a lower bound of 0 tok/s bounds no wall time: JSON's null, not "inf"
                f"{o.wall_hi_s:.2f}" if math.isfinite(o.wall_hi_s) else "unbounded",
                f"{o.confidence:.2f}",
            )
    out.print(table)
    if adv["bb_expected"] is None:
        out.print(f"no batch meets {deadline:g} s: even bb = 1 is predicted to take longer")
    else:
        safe = adv["bb_safe"]
        out.print(
            f"largest batch meeting {deadline:g} s: {adv['bb_expected']} by the point estimate, "
            + (f"{safe} with the pessimistic bound" if safe else "none with the pessimistic bound")
            + f" (held-out median error of this model {pred.cv_median_err_pct:.1f} %)"
        )
        if adv["bb_expected"] == max_batch:  # the answer is the search's edge, not the model's
            out.print(f"every batch up to --max-batch {max_batch} meets it; raise it to see more")
