"""`duetime bench eviction`: SnapKV vs StreamingLLM on the engine (cost and output kept).

Its options (``--model`` and ``--dtype`` included, and the fit of the longest
prompt in the model's context) are checked before the model loads.
"""

from __future__ import annotations

import random
from typing import Annotated

import typer

from duetime.cli.bench.model import load_prompted_model
from duetime.cli.bench.options import BenchModelOpt, PromptSeedOpt
from duetime.cli.bench.save import save_figures
from duetime.cli.common import DtypeOpt, JsonOpt, ThreadsOpt, _user_errors, bench_app, out
from duetime.comma_lists import comma_numbers


@bench_app.command("eviction")
def bench_eviction(
    model: BenchModelOpt = "gemma",
    prompts: Annotated[int, typer.Option(min=1, help="Prompts to continue.")] = 8,
    min_prompt: Annotated[int, typer.Option(min=1, help="Shortest prompt, tokens.")] = 256,
    max_prompt: Annotated[int, typer.Option(min=1, help="Longest prompt, tokens.")] = 512,
    new_tokens: Annotated[int, typer.Option(min=1, help="Greedy tokens after eviction.")] = 32,
    alphas: Annotated[str, typer.Option(help="Eviction ratios α, comma-separated.")] = "0.5",
    window: Annotated[int, typer.Option(min=1, help="SnapKV observation window w.")] = 32,
    chunk: Annotated[int, typer.Option(min=1, help="Prefill chunk, tokens.")] = 512,
    repeats: Annotated[int, typer.Option(min=1, help="Prefill timing repetitions.")] = 5,
    dtype: DtypeOpt = "fp32",
    threads: ThreadsOpt = 2,
    seed: PromptSeedOpt = 0,
    json_path: JsonOpt = None,
) -> None:
    """Prefill overhead of SnapKV's observation window, eviction time, and how close the
    greedy output after evicting α of the prompt's KV stays to the full-KV output."""
    import torch

    from duetime.bench import eviction as bench
    from duetime.bench.engine_fit import check_context, check_dtype, engine_context
    from duetime.metrics import render_table

    with _user_errors():
        ratios = parse_alphas(alphas)
        if min_prompt > max_prompt:
            raise ValueError(f"--min-prompt {min_prompt} exceeds --max-prompt {max_prompt}")
        check_dtype(dtype)
        # Every prompt (at most --max-prompt tokens) and its continuation must fit the
        # model's context, read without loading the weights: a 100,000-token prompt on
        # the tiny model (1,024 positions) ran for minutes.
        check_context(
            max_prompt + new_tokens,
            engine_context(model),
            f"--max-prompt {max_prompt} + --new-tokens {new_tokens}",
        )
        torch.set_num_threads(threads)
        m = load_prompted_model(model, dtype, seed)
        if model == "tiny":
            r = random.Random(seed)
            ids = [
                [r.randrange(m.config.vocab_size) for _ in range(r.randint(min_prompt, max_prompt))]
                for _ in range(prompts)
            ]
        else:
            ids = bench.sharegpt_prompts(prompts, min_prompt, max_prompt, seed)
        fig = bench.run(
            m, ids, alphas=ratios, new_tokens=new_tokens, window=window, chunk=chunk,
            repeats=repeats,
        )  # fmt: skip
        fig.update(model=model, dtype=dtype, seed=seed)
    out.print(render_table(bench.table_rows(fig), keys=list(fig["rows"][0])[2:]))
    out.print(
        f"prefill of {fig['prompt_tokens_max']} tokens: {fig['prefill_plain_s']:.4f} s plain, "
        f"{fig['prefill_watched_s']:.4f} s with the observation window "
        f"({fig['prefill_overhead_pct']:+.2f} %); the window's copies alone "
        f"{fig['capture_s'] * 1e3:.3f} ms ({fig['capture_pct_of_prefill']:.2f} % of the prefill); "
        f"wall {fig['wall_s']:.1f} s"
    )
    save_figures(fig, json_path=json_path)


def parse_alphas(alphas: str) -> list[float]:
    """``"0.5,0.75"`` → ``[0.5, 0.75]``: numbers in [0, 1), at least one (checked here,
    before the model loads, by the bench's own rule)."""
    from duetime.bench.eviction import check_alphas

    ratios = comma_numbers("--alphas", alphas, float, "numbers")
    check_alphas(ratios, name="--alphas")  # an empty list ran every prompt, then failed
    return ratios
