"""`duetime serve`: the OpenAI-compatible, deadline-aware server."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from duetime.cli.common import (
    DtypeOpt,
    EvictionOpt,
    HeaderTimeoutOpt,
    HostOpt,
    LogLevelOpt,
    PortOpt,
    ServedPredictorOpt,
    ShutdownTimeoutOpt,
    ThreadsOpt,
    _fail,
    _user_errors,
    app,
    err,
    parse_confidence,
)
from duetime.cli.paths import input_path, output_path
from duetime.server.autosize import BUSY_SPREAD_PCT, DEFAULT_TPOT_TARGET_MS
from duetime.server.recent_load import DEFAULT_BURST_GAP_S

if TYPE_CHECKING:  # (the server's modules import torch: not before it serves)
    from duetime.server.autosize import ServeLimits
    from duetime.server.build import ServeOptions


@app.command()
def serve(
    model: Annotated[
        str, typer.Option(help="'gemma' (packaged Gemma 3 270M), 'tiny' (random, tests) or a GGUF.")
    ] = "gemma",
    policy: Annotated[str, typer.Option(help="Any policy from `duetime policies`.")] = "edf",
    policy_args: Annotated[
        str | None, typer.Option(help='Policy keyword arguments as JSON: \'{"overrun": "kill"}\'.')
    ] = None,
    host: HostOpt = "127.0.0.1",
    port: PortOpt = 8000,
    served_model_name: Annotated[
        str | None, typer.Option(help="The model id clients send (default from the model).")
    ] = None,
    # q8 by default: ~2x fast and ~4x fp32 at batch 1, top-1 = fp32 at 99.2 % of 384
    # decode positions (docs/engine.md); falls back to fast without a compiler.
    dtype: DtypeOpt = "q8",
    threads: ThreadsOpt = 2,
    kv_capacity: Annotated[
        int,
        typer.Option(
            min=64,
            help="KV budget M in tokens (37 KB each on Gemma 3 270M); a request's prompt + "
            "max_tokens may hold at most M - 1.",
        ),
    ] = 32_768,
    max_num_seqs: Annotated[
        str,
        typer.Option(
            help="Largest running batch: a number, or auto (the largest whose decode step "
            "meets --tpot-target-ms, from the model's steps timed at start or --profile)."
        ),
    ] = "auto",
    max_batch_tokens: Annotated[
        str,
        typer.Option(
            help="Tokens per step, a token for each decoder and the rest for prompts: a "
            "number, or auto (max-num-seqs plus the largest prompt chunk a step of "
            "max-num-seqs decoders carries within twice the TPOT target)."
        ),
    ] = "auto",
    tpot_target_ms: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="The decode step (time per output token) auto sizes for; the default, 5 "
            "tokens a second, is about reading speed (docs/serve-load.md).",
        ),
    ] = DEFAULT_TPOT_TARGET_MS,
    sizing_context: Annotated[
        int,
        typer.Option(min=1, help="Tokens a running sequence holds, as auto sizing assumes."),
    ] = 512,
    max_waiting: Annotated[
        int, typer.Option(min=1, help="Queue limit: requests waiting before a new one gets a 429.")
    ] = 256,
    admission: Annotated[
        str,
        typer.Option(
            help="How a deadline is judged before a request is accepted: forecast (the "
            "engine's state played forward in the simulator under the served policy) or "
            "estimate (an optimistic formula; docs/server-admission.md)."
        ),
    ] = "forecast",
    deadline_confidence: Annotated[
        str | None,
        typer.Option(
            help="With --admission forecast, accept a request with a deadline only if its "
            "forecast, stretched by the recent forecasts' errors at this quantile, meets "
            "it: a target share of the accepted on time (docs/server-admission.md). A number in "
            "(0, 1), or off for the plain forecast. [default: 0.95]",
        ),
    ] = None,
    burst_gap_ms: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="With --admission forecast, requests arriving this close together make a "
            "burst, and the first of one is forecast with the companions such bursts "
            "brought lately (docs/server-forecast-inputs.md; 0: off).",
        ),
    ] = DEFAULT_BURST_GAP_S * 1000,
    prefix_cache: Annotated[
        int,
        typer.Option(
            min=0,
            help="Tokens of prompt KV kept for later prompts that begin the same way "
            "(automatic prefix caching; 0: off). Gemma 3 270M: 37 KB a token.",
        ),
    ] = 4096,
    predictor: ServedPredictorOpt = "auto",
    length_window: Annotated[
        int,
        typer.Option(
            min=0,
            help="The predictor's lengths are corrected by the served model's newest this "
            "many finished answers (docs/server-forecast-inputs.md; 0: off).",
        ),
    ] = 1000,
    profile: Annotated[
        Path | None,
        typer.Option(
            help="Fitted profile (`duetime profile`); default: fit online.", callback=input_path
        ),
    ] = None,
    telemetry: Annotated[
        Path | None, typer.Option(help="Per-step JSONL telemetry.", callback=output_path)
    ] = None,
    eviction: EvictionOpt = "snapkv",
    request_timeout: Annotated[
        float,
        typer.Option(min=0.001, help="Seconds an answer may take before it is a 504 and aborted."),
    ] = 600.0,
    stall_after: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="Seconds the engine may hold work without finishing a step before /health "
            "answers 503 (a gateway then sends its requests elsewhere).",
        ),
    ] = 30.0,
    shutdown_timeout: ShutdownTimeoutOpt = 30,
    header_timeout: HeaderTimeoutOpt = 30.0,
    log_level: LogLevelOpt = "info",
) -> None:
    """Serve the model over HTTP with OpenAI's API plus deadlines (see docs/server.md)."""
    from duetime.engine.malloc_tuning import keep_large_blocks

    # First, before any thread allocates: the engine steps on a thread of its own, which
    # shares the tuned heap only if no other thread made itself an arena before.
    keep_large_blocks()
    import torch

    from duetime.server.app import create_app
    from duetime.server.autosize import size_options
    from duetime.server.build import ServeOptions, build_state, check_options, load_served_model
    from duetime.server.ports import listening_socket
    from duetime.server.threaded import run_server

    with _user_errors():
        from duetime.engine.gemma3 import DTYPES

        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        kwargs = _policy_kwargs(policy_args)
        if profile is not None:  # its engine before the model loads
            from duetime.core.cost import LinearStepCost
            from duetime.predict.cost_report import check_profile_engine

            meta = LinearStepCost.from_profile(profile).meta
            check_profile_engine(meta, str(profile), dtype, threads)
        torch.set_num_threads(threads)
        seqs = _limit(max_num_seqs, "--max-num-seqs", 1)  # None: auto
        chunk = _limit(max_batch_tokens, "--max-batch-tokens", 16)
        options = ServeOptions(
            model=model,
            served_model_name=served_model_name,
            policy=policy,
            policy_kwargs=kwargs,
            dtype=dtype,
            kv_capacity=kv_capacity,
            max_num_seqs=seqs or 32,  # auto: set once the model is timed
            max_batch_tokens=chunk or 2048,
            max_waiting=max_waiting,
            admission=admission,
            deadline_confidence=_confidence(deadline_confidence, admission),
            burst_gap_s=burst_gap_ms / 1000,
            prefix_cache_tokens=prefix_cache,
            predictor=None if predictor == "none" else predictor,
            length_window=length_window,
            profile=profile,
            telemetry=telemetry,
            eviction=eviction,
            stall_after_s=stall_after,
            request_timeout_s=request_timeout,
        )
        check_options(options)  # all of them before the model loads, not after
        # the port once the options are checked, before minutes of loading and timing:
        # taken, it is an error at once
        sock = listening_socket(host, port)
        port = sock.getsockname()[1]
        try:
            loaded, codec, name = load_served_model(options)
        except ImportError as e:
            _fail(str(e))
        if options.profile is None and None in (seqs, chunk):
            err.print(
                "  timing the model's steps to size its batches (~10 s on 2 cores; --profile, "
                "or --max-num-seqs and --max-batch-tokens, skip it) ..."
            )
        sizing = size_options(
            options,
            loaded,
            auto_seqs=seqs is None,
            auto_tokens=chunk is None,
            tpot_target_s=tpot_target_ms / 1000,
            context=sizing_context,
        )
        options.limits = sizing.as_dict()
        state = build_state(options, loaded, codec, name)
    _announce(name, policy, host, port, options, sizing)
    app = create_app(state)
    run_server(
        app,
        sock=sock,
        log_level=log_level,
        shutdown_timeout_s=shutdown_timeout,
        header_timeout_s=header_timeout,
    )


def _policy_kwargs(text: str | None) -> dict[str, object]:
    """``--policy-args``: a JSON object of the policy's keyword arguments ({} if none)."""
    try:
        kwargs = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise ValueError(f"--policy-args is not valid JSON: {e.msg}") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--policy-args must be a JSON object")
    return kwargs


def _announce(
    name: str, policy: str, host: str, port: int, options: ServeOptions, sizing: ServeLimits
) -> None:
    """The start-up lines on stderr: where it serves, the batch limits and why they are
    what they are, and a request to try."""
    err.print(
        f"duetime: serving [bold]{name}[/] with policy [bold]{policy}[/] on "
        f"http://{host}:{port}/v1 (KV budget {options.kv_capacity} tokens)",
        highlight=False,
    )
    why = f"{sizing.source}"
    if sizing.decode_step_ms is not None:
        why += (
            f": decode step {sizing.decode_step_ms:.0f} ms at that batch and "
            f"{sizing.context_tokens} tokens a sequence, TPOT target {sizing.tpot_target_ms:g} ms"
        )
    err.print(
        f"  up to {options.max_num_seqs} sequences at once, {options.max_batch_tokens} "
        f"tokens a step, {sizing.prefill_chunk_tokens} of them for prompts beside a full "
        f"batch ({why})",
        highlight=False,
    )
    spread = sizing.timing_spread_pct
    if spread is not None and spread > BUSY_SPREAD_PCT:
        err.print(
            f"  [bold yellow]warning:[/] steps of one shape timed at start spread {spread:.0f} % "
            f"between repeats (a quiet machine: ~5 %): the machine is busy, and these limits "
            "are likely too small; restart when it is quiet, or pass --profile, or "
            "--max-num-seqs and --max-batch-tokens",
            highlight=False,
        )
    err.print(
        f"  try: curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json' "
        f'-d \'{{"model": "{name}", "prompt": "The capital of France is", "max_tokens": 16, '
        f'"deadline_ms": 5000}}\'',
        highlight=False,
        soft_wrap=True,
    )


def _confidence(text: str | None, admission: str) -> float | None:
    """``--deadline-confidence``: the default where not given (none with the estimate),
    None for ``off``; a number with ``--admission estimate`` is refused."""
    from duetime.server.build import DEFAULT_CONFIDENCE

    if text is None:
        return DEFAULT_CONFIDENCE if admission == "forecast" else None
    value = parse_confidence(text, "--deadline-confidence")
    if value is not None and admission != "forecast":
        raise ValueError("--deadline-confidence needs --admission forecast (or say off)")
    return value


def _limit(text: str, option: str, least: int) -> int | None:
    """``auto`` (None) or a whole number >= ``least``; a clear error otherwise."""
    if text.strip().lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{option} must be a number or auto, got {text!r}") from None
    if value < least:
        raise ValueError(f"{option} must be >= {least}, got {value}")
    return value
