"""Shared pieces of the `duetime` command line: the apps, consoles and error handling.

Every command that measures takes ``--json PATH`` and writes figures named
with their units. Bad input (a malformed trace, an unknown policy or profile,
a bad number) prints one line naming what is wrong and exits with code 2,
without a traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
from rich.console import Console

app = typer.Typer(
    name="duetime",
    help="Predictable LLM serving: simulate, schedule and serve with deadlines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
bench_app = typer.Typer(help="Benchmarks (speed targets live here, never in tests).")
app.add_typer(bench_app, name="bench")
predict_app = typer.Typer(help="Train and inspect predictors.", no_args_is_help=True)
app.add_typer(predict_app, name="predict")
advise_app = typer.Typer(help="Settings suggested by the analytic models.", no_args_is_help=True)
app.add_typer(advise_app, name="advise")

out = Console()
err = Console(stderr=True, soft_wrap=True)

JsonOpt = Annotated[
    Path | None, typer.Option("--json", help="Write the figures to this JSON file.")
]
PlotOpt = Annotated[Path | None, typer.Option("--plot", help="Write a PNG plot here.")]


def _fail(msg: str) -> NoReturn:
    err.print(f"[bold red]error:[/] {msg}", highlight=False)
    raise typer.Exit(2)


@contextmanager
def _user_errors() -> Iterator[None]:
    """Turn the errors users cause into one line and exit code 2."""
    from duetime.core.cost import CostModelError
    from duetime.core.policy import PolicyError
    from duetime.sim.simulator import SimulationError
    from duetime.workloads import TraceError

    try:
        yield
    except (TraceError, CostModelError, PolicyError, SimulationError, ValueError) as e:
        _fail(str(e))
    except FileNotFoundError as e:
        _fail(f"{e.filename}: file not found")


def _progress(total: int, label: str) -> tuple[Any, Callable[[int, int], None]]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    prog = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
        disable=not sys.stderr.isatty(),
    )
    task = prog.add_task(label, total=total)
    return prog, lambda done, n: prog.update(task, completed=done, total=n)
