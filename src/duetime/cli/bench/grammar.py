"""`duetime bench grammar`: time a token with and without structured outputs, side by side."""

from __future__ import annotations

from typing import Annotated

import typer

from duetime.cli.bench.model import load_prompted_model
from duetime.cli.bench.options import BenchModelOpt, PromptSeedOpt, RepeatsOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.common import (
    DtypeOpt,
    JsonOpt,
    ThreadsOpt,
    _user_errors,
    bench_app,
    comma_list,
    out,
)


@bench_app.command("grammar")
def bench_grammar(
    model: BenchModelOpt = "gemma",
    requests: Annotated[
        int, typer.Option(min=1, max=64, help="Concurrent requests (one batch).")
    ] = 4,
    new_tokens: Annotated[int, typer.Option(min=1, max=512, help="Tokens per answer.")] = 64,
    kinds: Annotated[
        str, typer.Option(help="Comma-separated grammars: json_schema, json_array, regex, lark.")
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
        int, typer.Option(min=0, help="Commands per admission arm (0: no admission part).")
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
    import functools
    import random

    import torch

    from duetime.bench import grammar as bench
    from duetime.bench.engine_fit import check_context, check_dtype, engine_context
    from duetime.engine.grammar import GrammarCompiler
    from duetime.metrics import render_table

    with _user_errors():
        check_dtype(dtype)
        chosen = comma_list(kinds)
        unknown = [k for k in chosen if k not in bench.GRAMMARS]
        if unknown or not chosen:
            raise ValueError(
                f"--kinds: unknown {', '.join(unknown) or '(none given)'}; "
                f"choose from {', '.join(bench.GRAMMARS)}"
            )
        check_context(128 + new_tokens, engine_context(model), f"--new-tokens {new_tokens}")
        torch.set_num_threads(threads)
        if model == "tiny":
            from duetime.server.codec import ByteCodec

            codec = ByteCodec()
            m = load_prompted_model(model, dtype, seed, vocab_size=codec.vocab_size)
            r = random.Random(seed)
            prompts = [codec.encode(f"request {i} {r.random():.6f}") for i in range(requests)]
            decode = codec.decode
        else:
            from duetime.bench.eviction import sharegpt_prompts
            from duetime.server.codec import GemmaCodec

            gemma = GemmaCodec()
            m = load_prompted_model(model, dtype, seed)
            prompts = sharegpt_prompts(requests, 16, 128, seed)
            decode = gemma.decode
            codec = gemma  # type: ignore[assignment]
        compiler = GrammarCompiler(codec.guidance_tokenizer)
        fig = bench.run(
            m,
            compiler,
            decode,
            prompts,
            new_tokens=new_tokens,
            repeats=repeats,
            kinds=chosen,
            whole_rows=whole_rows,
        )
        fig["jump_forward"] = bench.run_jump(m, compiler, prompts, repeats=repeats)
        if admission_requests:
            from duetime.server.build import ServeOptions, build_state
            from duetime.server.recent_load import DEFAULT_BURST_GAP_S

            name = "tiny" if model == "tiny" else "gemma-3-270m"

            def make_state(burst_gap_s: float = DEFAULT_BURST_GAP_S) -> object:
                options = ServeOptions(model=model, dtype=dtype, seed=seed, burst_gap_s=burst_gap_s)
                return build_state(options, m, codec, name)

            fig["admission"] = {
                arm: bench.run_admission(
                    make_state,
                    name,
                    requests=admission_requests,
                    deadline_ms=admission_deadline_ms,
                    learn=arm == "grammar_steps",
                )
                for arm in ("grammar_steps", "step_per_token")
            }
            if admission_burst:
                # one fleet's bursts, their companions expected (the server's default) or
                # not: under ten times the deadline, every forecast seen; then under it
                fig["admission_bursts"] = {
                    arm: {
                        pass_: bench.run_bursts(
                            functools.partial(make_state, gap),
                            name,
                            size=admission_burst,
                            rounds=rounds,
                            deadline_ms=admission_deadline_ms * stretch,
                        )
                        for pass_, rounds, stretch in (
                            ("seen", min(5, admission_burst_rounds), 10),
                            ("deadline", admission_burst_rounds, 1),
                        )
                    }
                    for arm, gap in (("expected", DEFAULT_BURST_GAP_S), ("even", 0.0))
                }
        fig.update(model=model, dtype=dtype, threads=threads, seed=seed)
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
    jf = fig["jump_forward"]
    out.print(
        f"jump-forward, a robot command's JSON: {jf['on']['forced_tokens_jumped']} of "
        f"{jf['on']['tokens']} tokens fed in chunks; {jf['off']['engine_steps']} -> "
        f"{jf['on']['engine_steps']} steps, {jf['off']['wall_s']:.3f} -> "
        f"{jf['on']['wall_s']:.3f} s ({jf['speedup']:.2f}x); answers identical "
        f"{jf['answers_identical']}"
    )
    for arm, adm in fig.get("admission", {}).items():
        pairs = [
            f"{f:.0f}/{a:.0f}" for f, a in zip(adm["forecast_e2e_ms"], adm["e2e_ms"], strict=True)
            if f is not None
        ]  # fmt: skip
        out.print(
            f"admission ({arm.replace('_', ' ')}), {adm['requests']} robot commands under "
            f"{adm['deadline_ms']:.0f} ms: {adm['accepted']} accepted, {adm['met']} met"
            + (f"; forecast/actual e2e ms {', '.join(pairs)}" if pairs else "")
            + (
                f" (median ratio {adm['forecast_to_actual_e2e_median']:.2f})"
                if adm.get("forecast_to_actual_e2e_median") is not None
                else ""
            )
        )
    for arm, passes in fig.get("admission_bursts", {}).items():
        seen, tight = passes["seen"], passes["deadline"]
        first = ", ".join(f"{r:.2f}" for r in seen["smallest_forecast_to_e2e"])
        median = seen["forecast_to_e2e_median"]
        out.print(
            f"bursts of {seen['size']} every {seen['period_s']:g} s, "
            f"{'companions expected' if arm == 'expected' else 'no bursts expected'}: "
            f"under {seen['deadline_ms']:.0f} ms, the first judged of each round forecast at "
            f"{first or '-'} of its e2e (all: median {'-' if median is None else f'{median:.2f}'}"
            f"); under {tight['deadline_ms']:.0f} ms, {tight['rounds']} rounds: "
            f"{tight['accepted']} accepted, {tight['met']} met"
        )
    save_figures(fig, json_path=json_path)
