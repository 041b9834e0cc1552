"""`duetime bench grammar`: time a token with and without structured outputs, side by side."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Any

import typer

from duetime.cli.bench.model import load_prompted_model
from duetime.cli.bench.options import BenchModelOpt, PromptSeedOpt, RepeatsOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.common import DtypeOpt, JsonOpt, ThreadsOpt, _user_errors, bench_app, out
from duetime.comma_lists import comma_list

if TYPE_CHECKING:  # (imported when the command runs: the CLI starts without them)
    from duetime.server.codec import Codec


@bench_app.command("grammar")
def bench_grammar(
    model: BenchModelOpt = "gemma",
    requests: Annotated[
        int, typer.Option(min=1, max=64, help="Concurrent requests (one batch).")
    ] = 4,
    new_tokens: Annotated[int, typer.Option(min=1, max=512, help="Tokens per answer.")] = 64,
    kinds: Annotated[
        str,
        typer.Option(help="Comma-separated grammars to try: json_schema, json_array, regex, lark."),
    ] = "json_schema,json_array,regex,lark",
    repeats: RepeatsOpt = 3,
    whole_rows: Annotated[
        bool,
        typer.Option(
            help="Also serve each grammar with every row's whole logits masked (as before "
            "rows with few allowed tokens took only theirs), for gather_speedup.",
        ),
    ] = True,
    dtype: DtypeOpt = "q8",
    threads: ThreadsOpt = 2,
    seed: PromptSeedOpt = 0,
    admission_deadline_ms: Annotated[
        float,
        typer.Option(
            min=1.0,
            help="Robot commands sent under this deadline through the server, judged by "
            "the steps the grammar's answers take and by a step a token.",
        ),
    ] = 500.0,
    admission_requests: Annotated[
        int,
        typer.Option(
            min=0, help="Robot commands sent per admission arm (0: skip the admission part)."
        ),
    ] = 10,
    admission_burst: Annotated[
        int,
        typer.Option(
            min=0,
            max=64,
            help="Then a fleet of this many robots sends a command each, together, every "
            "2 s, with each burst's companions expected and not: under 10x the deadline, "
            "then under it (0: no bursts).",
        ),
    ] = 6,
    admission_burst_rounds: Annotated[
        int,
        typer.Option(min=1, help="Rounds of bursts under the deadline (under 10x it: at most 5)."),
    ] = 15,
    json_path: JsonOpt = None,
) -> None:
    """Serve one batch of prompts unconstrained and under each grammar (JSON schema, JSON
    array, regex, Lark), and compare the time a token takes; every constrained answer is
    checked against its grammar."""
    with _user_errors():
        chosen = _checked_kinds(model, dtype, kinds, new_tokens)
        m, codec, prompts = _model_and_prompts(model, dtype, threads, seed, requests)
        fig = _grammar_runs(
            m,
            codec,
            prompts,
            kinds=chosen,
            new_tokens=new_tokens,
            repeats=repeats,
            whole_rows=whole_rows,
        )
        if admission_requests:
            fig.update(
                _admission_parts(
                    m,
                    codec,
                    model=model,
                    dtype=dtype,
                    seed=seed,
                    requests=admission_requests,
                    deadline_ms=admission_deadline_ms,
                    burst=admission_burst,
                    burst_rounds=admission_burst_rounds,
                )
            )
        fig.update(model=model, dtype=dtype, threads=threads, seed=seed)
    _print_report(fig)
    save_figures(fig, json_path=json_path)


# --- the checks and the runs (inside the command's `_user_errors()` scope) ------------


def _checked_kinds(model: str, dtype: str, kinds: str, new_tokens: int) -> list[str]:
    """The grammars ``--kinds`` names, once ``--dtype``, ``--kinds`` and the prompt plus
    ``--new-tokens`` against the model's context are checked (in that order): a typo
    fails before the model loads."""
    from duetime.bench import grammar as bench
    from duetime.bench.engine_fit import check_context, check_dtype, engine_context

    check_dtype(dtype)
    chosen = comma_list(kinds)
    unknown = [k for k in chosen if k not in bench.GRAMMARS]
    if unknown or not chosen:
        raise ValueError(
            f"--kinds: unknown {', '.join(unknown) or '(none given)'}; "
            f"choose from {', '.join(bench.GRAMMARS)}"
        )
    check_context(128 + new_tokens, engine_context(model), f"--new-tokens {new_tokens}")
    return chosen


def _model_and_prompts(
    model: str, dtype: str, threads: int, seed: int, requests: int
) -> tuple[Any, Codec, list[list[int]]]:
    """The model on ``threads`` torch threads, its codec and ``requests`` prompts: on
    ``tiny``, byte-codec text seeded by ``seed`` (a vocabulary the byte codec covers);
    else ShareGPT prompts of 16 to 128 Gemma tokens."""
    import torch

    torch.set_num_threads(threads)
    if model == "tiny":
        import random

        from duetime.server.codec import ByteCodec

        codec = ByteCodec()
        m = load_prompted_model(model, dtype, seed, vocab_size=codec.vocab_size)
        r = random.Random(seed)
        return m, codec, [codec.encode(f"request {i} {r.random():.6f}") for i in range(requests)]
    from duetime.bench.eviction import sharegpt_prompts
    from duetime.server.codec import GemmaCodec

    gemma = GemmaCodec()
    m = load_prompted_model(model, dtype, seed)
    return m, gemma, sharegpt_prompts(requests, 16, 128, seed)


def _grammar_runs(
    m: Any,
    codec: Codec,
    prompts: list[list[int]],
    *,
    kinds: list[str],
    new_tokens: int,
    repeats: int,
    whole_rows: bool,
) -> dict[str, Any]:
    """The batch timed free and under each grammar, then jump-forward off and on: one
    grammar compiler over the codec's vocabulary serves both."""
    from duetime.bench import grammar as bench
    from duetime.engine.grammar import GrammarCompiler

    compiler = GrammarCompiler(codec.guidance_tokenizer)
    fig = bench.run(
        m,
        compiler,
        codec.decode,
        prompts,
        new_tokens=new_tokens,
        repeats=repeats,
        kinds=kinds,
        whole_rows=whole_rows,
    )
    fig["jump_forward"] = bench.run_jump(m, compiler, prompts, repeats=repeats)
    return fig


def _admission_parts(
    m: Any,
    codec: Codec,
    *,
    model: str,
    dtype: str,
    seed: int,
    requests: int,
    deadline_ms: float,
    burst: int,
    burst_rounds: int,
) -> dict[str, Any]:
    """Robot commands through a fresh server per arm, judged by the grammar's steps and
    by a step a token (``admission``), then the fleet's bursts (``admission_bursts``,
    unless ``burst`` is 0): the figures the command adds to its own."""
    from duetime.bench import grammar as bench
    from duetime.server.build import ServeOptions, build_state
    from duetime.server.recent_load import DEFAULT_BURST_GAP_S

    name = "tiny" if model == "tiny" else "gemma-3-270m"

    def make_state(burst_gap_s: float = DEFAULT_BURST_GAP_S) -> object:
        options = ServeOptions(model=model, dtype=dtype, seed=seed, burst_gap_s=burst_gap_s)
        return build_state(options, m, codec, name)

    parts: dict[str, Any] = {
        "admission": {
            arm: bench.run_admission(
                make_state,
                name,
                requests=requests,
                deadline_ms=deadline_ms,
                learn=arm == "grammar_steps",
            )
            for arm in ("grammar_steps", "step_per_token")
        }
    }
    if burst:
        parts["admission_bursts"] = _burst_passes(
            make_state, name, size=burst, rounds=burst_rounds, deadline_ms=deadline_ms
        )
    return parts


def _burst_passes(
    make_state: Callable[[float], object],
    name: str,
    *,
    size: int,
    rounds: int,
    deadline_ms: float,
) -> dict[str, dict[str, Any]]:
    """One fleet's bursts, their companions expected (the server's default gap) or not:
    under ten times the deadline, at most 5 rounds, every forecast seen; then under it."""
    from duetime.bench import grammar as bench
    from duetime.server.recent_load import DEFAULT_BURST_GAP_S

    return {
        arm: {
            pass_: bench.run_bursts(
                functools.partial(make_state, gap),
                name,
                size=size,
                rounds=pass_rounds,
                deadline_ms=deadline_ms * stretch,
            )
            for pass_, pass_rounds, stretch in (
                ("seen", min(5, rounds), 10),
                ("deadline", rounds, 1),
            )
        }
        for arm, gap in (("expected", DEFAULT_BURST_GAP_S), ("even", 0.0))
    }


# --- the report (printed after the scope: these are figures, not user errors) ----------


def _print_report(fig: dict[str, Any]) -> None:
    """The table of runs, then one line a part of the bench that ran."""
    from duetime.bench import grammar as bench
    from duetime.metrics import render_table

    out.print(render_table(bench.table_columns(fig), keys=bench.TABLE_KEYS))
    out.print(
        f"{fig['requests']} requests x {fig['new_tokens']} tokens: a grammar costs at most "
        f"{fig['worst_overhead_pct']:.1f} % more time a token; the tokenizer table took "
        f"{fig['tokenizer_build_s']:.2f} s to build (once per process)"
    )
    if fig["gather_speedup"]:
        out.print(
            "few allowed tokens' logits gathered, against whole rows masked: "
            + ", ".join(f"{k} {v:.2f}x" for k, v in fig["gather_speedup"].items())
        )
    out.print(_jump_forward_line(fig["jump_forward"]))
    for arm, adm in fig.get("admission", {}).items():
        out.print(_admission_line(arm, adm))
    for arm, passes in fig.get("admission_bursts", {}).items():
        out.print(_bursts_line(arm, passes))


def _jump_forward_line(jf: dict[str, Any]) -> str:
    """How many forced tokens jump-forward fed in chunks, and the steps and time saved."""
    return (
        f"jump-forward, a robot command's JSON: {jf['on']['forced_tokens_jumped']} of "
        f"{jf['on']['tokens']} tokens fed in chunks; {jf['off']['engine_steps']} -> "
        f"{jf['on']['engine_steps']} steps, {jf['off']['wall_s']:.3f} -> "
        f"{jf['on']['wall_s']:.3f} s ({jf['speedup']:.2f}x); answers identical "
        f"{jf['answers_identical']}"
    )


def _admission_line(arm: str, adm: dict[str, Any]) -> str:
    """One admission arm: accepted and met, and each forecast beside its actual e2e."""
    pairs = [
        f"{f:.0f}/{a:.0f}" for f, a in zip(adm["forecast_e2e_ms"], adm["e2e_ms"], strict=True)
        if f is not None
    ]  # fmt: skip
    return (
        f"admission ({arm.replace('_', ' ')}), {adm['requests']} robot commands under "
        f"{adm['deadline_ms']:.0f} ms: {adm['accepted']} accepted, {adm['met']} met"
        + (f"; forecast/actual e2e ms {', '.join(pairs)}" if pairs else "")
        + (
            f" (median ratio {adm['forecast_to_actual_e2e_median']:.2f})"
            if adm.get("forecast_to_actual_e2e_median") is not None
            else ""
        )
    )


def _bursts_line(arm: str, passes: dict[str, dict[str, Any]]) -> str:
    """One burst arm: how early the first judged of each round was forecast (the loose
    pass), then accepted and met under the deadline itself."""
    seen, tight = passes["seen"], passes["deadline"]
    first = ", ".join(f"{r:.2f}" for r in seen["smallest_forecast_to_e2e"])
    median = seen["forecast_to_e2e_median"]
    return (
        f"bursts of {seen['size']} every {seen['period_s']:g} s, "
        f"{'companions expected' if arm == 'expected' else 'no bursts expected'}: "
        f"under {seen['deadline_ms']:.0f} ms, the first judged of each round forecast at "
        f"{first or '-'} of its e2e (all: median {'-' if median is None else f'{median:.2f}'}"
        f"); under {tight['deadline_ms']:.0f} ms, {tight['rounds']} rounds: "
        f"{tight['accepted']} accepted, {tight['met']} met"
    )
