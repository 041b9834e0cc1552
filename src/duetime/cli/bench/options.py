"""Options that several `duetime bench` commands share with the same meaning.

Defined once so that a fix to a default or a help text reaches every command
that takes the option; commands whose option means something else (another
default, another help) keep their own declaration.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import typer

from duetime.cli.common import _fail
from duetime.cli.paths import input_path

SeedOpt = Annotated[int, typer.Option(min=0)]
WorkersOpt = Annotated[int, typer.Option(min=1, help="Parallel workers.")]

# The commands that always run the engine on a model (`prefix-cache`, `shared-prefill`,
# `grammar`, `eviction`); each picks its own default dtype.
BenchModelOpt = Annotated[
    str,
    typer.Option(help="'gemma' (Gemma 3 270M, ShareGPT prompts), 'tiny' (random) or a GGUF."),
]
PromptSeedOpt = Annotated[int, typer.Option(min=0, help="Prompt sampling seed.")]
RepeatsOpt = Annotated[int, typer.Option(min=1, help="Interleaved repetitions (medians).")]

# The benches that run `duetime serve`: the model of `serve` and `serve-load`, the policy
# of `serve-load` and `admission`, the policies `serve` (and `sensitivity`) compare.
ServedModelOpt = Annotated[
    str, typer.Option(help="gemma (real), tiny (random, seconds) or a Gemma 3 GGUF path.")
]
ServedPolicyOpt = Annotated[str, typer.Option(help="The served policy.")]
PoliciesOpt = Annotated[str, typer.Option(help="Comma-separated policies.")]

# The real-engine options of the commands whose `--engine` loads any engine model
# (`amin`, `deferred-prefill`); unset means "the engine mode's default".
EngineModelOpt = Annotated[
    str | None, typer.Option(help="--engine: gemma (default), tiny or a GGUF path.")
]
EngineDtypeOpt = Annotated[
    str | None, typer.Option(help="--engine: fp32 (default), fast, q8, bf16 or int8.")
]
# `timebill` and `timelyllm`, whose --engine runs default to fast.
FastEngineDtypeOpt = Annotated[
    str | None, typer.Option(help="--engine: fp32, fast (default), q8, bf16 or int8.")
]
EngineThreadsOpt = Annotated[
    int | None, typer.Option(min=1, help="--engine: torch threads [1: a shared 2-core machine].")
]
# The simulator's step costs, or with --engine the engine's (timed when not given).
EngineProfileOpt = Annotated[
    str | None,
    typer.Option(
        help="Step-cost profile, a shipped name or JSON path [a100-llama2-7b]; --engine: this "
        "engine's (timed if not given).",
        callback=input_path,
    ),
]
EngineClockOpt = Annotated[
    str | None,
    typer.Option(
        help="--engine: time the engine in cpu seconds of this process (1 thread) or wall [cpu]."
    ),
]


def no_engine_options(given: Mapping[str, object]) -> None:
    """Engine-only options without ``--engine`` are a mistake, not something to ignore."""
    bad = [name for name, v in given.items() if v is not None]
    if bad:
        _fail(f"{', '.join(bad)}: only with --engine")
