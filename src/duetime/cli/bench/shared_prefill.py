"""`duetime bench shared-prefill`: TTFT of bursts that start alike, shared prefills off / on."""

from __future__ import annotations

from typing import Annotated

import typer

from duetime.cli.bench.model import check_questions_fit, load_with_shared_prompts
from duetime.cli.bench.options import BenchModelOpt, PromptSeedOpt, RepeatsOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.bench.shared_prompt_options import NewTokensOpt, QuestionLenOpt, SystemLenOpt
from duetime.cli.common import DtypeOpt, JsonOpt, ThreadsOpt, _user_errors, bench_app, out


@bench_app.command("shared-prefill")
def bench_shared_prefill(
    model: BenchModelOpt = "gemma",
    copies: Annotated[int, typer.Option(min=2, max=64, help="Copies of a prompt (n choices).")] = 4,
    prompt_len: Annotated[int, typer.Option(min=17, help="Their prompt, tokens.")] = 512,
    requests: Annotated[
        int, typer.Option(min=2, max=64, help="Requests behind one system prompt.")
    ] = 8,
    system_len: SystemLenOpt = 512,
    question_len: QuestionLenOpt = 64,
    new_tokens: NewTokensOpt = 16,
    repeats: RepeatsOpt = 3,
    dtype: DtypeOpt = "q8",
    threads: ThreadsOpt = 2,
    seed: PromptSeedOpt = 0,
    json_path: JsonOpt = None,
) -> None:
    """Serve two bursts a prefix cache cannot help (copies of one prompt; requests behind
    one system prompt, all arriving together) with shared prefills off and on, and
    compare their time to first token, the prefill computed and the answers."""
    from duetime.bench import shared_prefill as bench
    from duetime.bench.engine_fit import check_context, check_dtype, engine_context
    from duetime.metrics import render_table

    with _user_errors():
        check_dtype(dtype)
        context = engine_context(model)
        check_context(prompt_len + new_tokens, context, f"--prompt-len {prompt_len} + --new-tokens")
        check_questions_fit(system_len, question_len, new_tokens, context)
        lengths = (prompt_len, system_len)
        m, (prompt, system), questions = load_with_shared_prompts(
            model, dtype, threads, seed, lengths, 8 * 1024, requests, question_len
        )
        fig = bench.run(
            m, prompt, copies, system, questions, new_tokens=new_tokens, repeats=repeats
        )
        fig.update(model=model, dtype=dtype, threads=threads, seed=seed)
    out.print(render_table(bench.table_columns(fig), keys=bench.TABLE_KEYS))
    for burst, what in (("choices", f"{copies} copies"), ("system", f"{requests} requests")):
        b = fig[burst]
        out.print(
            f"{burst} ({what}): TTFT p50 {b['ttft_p50_speedup']:.2f}x, max "
            f"{b['ttft_max_speedup']:.2f}x, mean e2e {b['e2e_speedup']:.2f}x faster with "
            f"shared prefills; {b['prefill_saved_pct']:.1f} % less prefill computed; "
            f"answers identical {b['answers_identical']}/{b['requests']}"
        )
    save_figures(fig, json_path=json_path)
