"""`duetime bench prefix-cache`: TTFT with and without automatic prefix caching, side by side."""

from __future__ import annotations

from typing import Annotated

import typer

from duetime.cli.bench.model import check_questions_fit, load_with_shared_prompts
from duetime.cli.bench.options import BenchModelOpt, PromptSeedOpt, RepeatsOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.bench.shared_prompt_options import NewTokensOpt, QuestionLenOpt, SystemLenOpt
from duetime.cli.common import DtypeOpt, JsonOpt, ThreadsOpt, _user_errors, bench_app, out


@bench_app.command("prefix-cache")
def bench_prefix_cache(
    model: BenchModelOpt = "gemma",
    requests: Annotated[int, typer.Option(min=2, max=200, help="Requests sharing the prompt.")] = 8,
    system_len: SystemLenOpt = 512,
    question_len: QuestionLenOpt = 64,
    new_tokens: NewTokensOpt = 16,
    repeats: RepeatsOpt = 3,
    cache_tokens: Annotated[
        int,
        typer.Option(
            min=16, help="The engine's prefix cache budget, tokens (serve --prefix-cache)."
        ),
    ] = 4096,
    dtype: DtypeOpt = "q8",
    threads: ThreadsOpt = 2,
    seed: PromptSeedOpt = 0,
    json_path: JsonOpt = None,
) -> None:
    """Serve requests that share a long prompt one at a time, without and with the
    prefix cache (the first request fills it; runs interleaved, medians over the
    repeats), and compare their time to first token and their answers."""
    from duetime.bench import prefix_cache as bench
    from duetime.bench.engine_fit import check_dtype, engine_context
    from duetime.metrics import render_table

    with _user_errors():
        check_dtype(dtype)
        check_questions_fit(system_len, question_len, new_tokens, engine_context(model))
        if cache_tokens < system_len:
            raise ValueError(
                f"--cache-tokens {cache_tokens} cannot hold the --system-len {system_len} prompt"
            )
        m, (system,), questions = load_with_shared_prompts(
            model, dtype, threads, seed, (system_len,), 4 * system_len, requests, question_len
        )
        fig = bench.run(
            m, system, questions, new_tokens=new_tokens, cache_tokens=cache_tokens, repeats=repeats
        )
        fig.update(model=model, dtype=dtype, threads=threads, seed=seed)
    out.print(render_table(bench.table_columns(fig), keys=bench.TABLE_KEYS))
    out.print(
        f"{fig['requests'] - 1} requests after the first: TTFT p50 "
        f"{fig['ttft_speedup']:.2f}x faster with the cache, mean e2e {fig['e2e_speedup']:.2f}x; "
        f"{fig['hit_rate_pct']:.1f} % of their prompt tokens came from it; "
        f"answers identical {fig['answers_identical']}/{fig['requests']}"
    )
    save_figures(fig, json_path=json_path)
