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
from typing import Annotated, Any, NoReturn, TypedDict, cast

import typer
from rich.markup import escape

from duetime.cli.console import err
from duetime.cli.console import out as out  # the commands import both consoles from here
from duetime.cli.paths import input_path, output_path

app = typer.Typer(
    name="duetime",
    help="Predictable LLM serving: simulate, schedule and serve with deadlines.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,  # help texts are plain: "[a100-llama2-7b]" is a default, not a tag
)
bench_app = typer.Typer(
    help="Benchmarks (speed targets live here, never in tests).", rich_markup_mode=None
)
app.add_typer(bench_app, name="bench")
predict_app = typer.Typer(
    help="Train and inspect predictors.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(predict_app, name="predict")
advise_app = typer.Typer(
    help="Settings suggested by the analytic models.", no_args_is_help=True, rich_markup_mode=None
)
app.add_typer(advise_app, name="advise")


def _print_version(value: bool) -> None:
    if value:
        from duetime import __version__

        print(f"duetime {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="Print the version and exit."
        ),
    ] = False,
) -> None:
    """Options of `duetime` itself, before a command."""
    out.to_stderr = False  # set again by a command whose figures go to standard output


JsonOpt = Annotated[
    Path | None,
    typer.Option("--json", help="Write the figures to this JSON file.", callback=output_path),
]
PlotOpt = Annotated[
    Path | None,
    typer.Option(
        "--plot", help="Write the plot here (PNG; .pdf or .svg by name).", callback=output_path
    ),
]

# The embedded engine's (`serve`, `profile`, `validate`, the engine benches); each
# command picks its own default.
DtypeOpt = Annotated[
    str,
    typer.Option(
        help="fp32 (exact), fast (int8 head rescored in fp32), q8 (fast + int8 decode "
        "kernel), bf16 or int8."
    ),
]
ThreadsOpt = Annotated[int, typer.Option(min=1, help="Torch compute threads.")]
#: The engine's KV eviction when a policy asks for it (`serve`, `validate`).
EvictionOpt = Annotated[
    str,
    typer.Option(
        help="KV eviction when the policy asks for ratio α (e.g. timebill): "
        "snapkv (observation-window scores, per head) or streaming (sinks + recent)."
    ),
]
#: The length predictor `duetime serve` runs (`serve`, `bench admission`).
ServedPredictorOpt = Annotated[
    str, typer.Option(help="The server's length predictor: auto, learned[:path] or none.")
]
#: The ALA throughput measurements (`advise batch`, `predict throughput`, `bench ala`).
AlaDataOpt = Annotated[
    list[Path] | None,
    typer.Option(
        help="A throughput CSV; repeat for several (default: the shipped ones).",
        callback=input_path,
    ),
]

#: A step-cost profile for the simulator (`sim`, `sweep`, `advise deferred-prefill`,
#: `bench sensitivity`): one of the shipped profiles (`duetime profiles`) or a profile JSON.
ProfileOpt = Annotated[
    str, typer.Option(help="Shipped profile name or JSON path.", callback=input_path)
]

# How generated requests arrive (`sim`, `sweep`, `load`): workloads/arrivals.py.
ArrivalOpt = Annotated[str, typer.Option(help="poisson, gamma or bursts.")]


def rate_text(option: str, value: float) -> str | None:
    """Why ``value`` is no arrival rate for ``option`` (0, a negative, NaN), or None."""
    if value > 0:  # inf too: every request at the start
        return None
    return f"{option} must be > 0 requests/s (inf: everything at the start), got {value:g}"


class OptionError(typer.BadParameter):
    """A bad option value, shown as the one line :func:`_fail` prints (no usage lines).
    Still a ``BadParameter`` with exit code 2, so what checks parsing alone (the docs'
    quoted commands) sees it as the error it is."""

    def format_message(self) -> str:
        return self.message

    def show(self, file: Any = None) -> None:
        _error_line(self.message)


def positive_rate(param: typer.CallbackParam, value: float | None) -> float | None:
    """Option callback: an arrival rate, refused in one line naming the option."""
    if value is not None and (why := rate_text(param.opts[0], value)) is not None:
        raise OptionError(why, param=cast(Any, param))
    return value


def gamma_cv(param: typer.CallbackParam, value: float) -> float:
    """Option callback: a gamma coefficient of variation within the arrivals' bounds."""
    from duetime.workloads.arrivals import CV_MAX, CV_MIN

    if not CV_MIN <= value <= CV_MAX:  # NaN too
        raise OptionError(
            f"{param.opts[0]} must be a gamma coefficient of variation in "
            f"[{CV_MIN:g}, {CV_MAX:g}] (1: Poisson), got {value:g}",
            param=cast(Any, param),
        )
    return value


#: An arrival rate, requests/s (`sim`, `demo`, `validate`; each picks its default).
RateOpt = Annotated[
    float,
    typer.Option(
        help="Arrival rate, requests/s (> 0; inf: everything at the start).",
        callback=positive_rate,
    ),
]
CvOpt = Annotated[
    float,
    typer.Option(
        help="--arrival gamma: coefficient of variation of the gaps, 0.001 to 1000 "
        "(1: Poisson; above 1: burstier).",
        callback=gamma_cv,
    ),
]
BurstSizeOpt = Annotated[
    int, typer.Option(min=1, help="--arrival bursts: requests sent at once, a burst.")
]

# The requests `duetime load` builds (server/load_workload.py), which `bench fleet-real`
# and `bench admission` build too: ShareGPT pairs past the caps are left out, not cut.
# Each command picks its own defaults.
MaxTokensOpt = Annotated[
    int, typer.Option(min=1, help="Longest answer, tokens (longer ShareGPT pairs left out).")
]
MaxContextOpt = Annotated[
    int, typer.Option(min=2, help="Longest prompt + answer, tokens (longer pairs left out).")
]
FixedMaxTokensOpt = Annotated[
    int | None,
    typer.Option(
        min=1,
        help="Every ShareGPT request asks for at most this many tokens, as a chat client "
        "does, not for its recorded answer's length (which tells the server how long "
        "the answer is; vLLM's --sharegpt-output-len).",
    ),
]


class DrawnShape(TypedDict):
    """The request shapes `duetime load` and `bench fleet-real` draw, as both their
    configs name them: :func:`drawn_shape` parses them from the options."""

    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    class_mix: dict[str, float]
    deadlines: dict[str, float]


def drawn_shape(
    prompt_len: str, output_len: str, class_mix: str | None, deadline: list[str] | None
) -> DrawnShape:
    """``--prompt-len``, ``--output-len``, ``--class-mix`` and ``--deadline`` parsed in
    that order (their order in `duetime load --help`); a bad one is named."""
    from duetime.server import load_workload as lw

    return DrawnShape(
        prompt_len=lw.parse_range(prompt_len, "--prompt-len"),
        output_len=lw.parse_range(output_len, "--output-len"),
        class_mix=lw.parse_mix(class_mix),
        deadlines=lw.parse_deadlines(deadline or []),
    )


_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def _log_level(value: str) -> str:
    if value.lower() not in _LOG_LEVELS:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(_LOG_LEVELS)}")
    return value.lower()


LogLevelOpt = Annotated[
    str, typer.Option(help=f"uvicorn log level: {', '.join(_LOG_LEVELS)}.", callback=_log_level)
]
#: Where `duetime serve` and `duetime gateway` listen.
HostOpt = Annotated[str, typer.Option(help="Address to bind.")]
PortOpt = Annotated[int, typer.Option(min=0, max=65535, help="TCP port (0: any free one).")]
#: After SIGTERM / Ctrl-C a server waits this long for open requests, then closes them:
#: without a bound, one client that sent half a request kept it running forever.
ShutdownTimeoutOpt = Annotated[
    int,
    typer.Option(
        min=0,
        help="Seconds to let open requests finish after SIGTERM or Ctrl-C before closing them.",
    ),
]
#: A connection that has not sent a whole request's headers by then is closed with a
#: 408 (slowloris); uvicorn itself times out only idle kept-alive connections.
HeaderTimeoutOpt = Annotated[
    float,
    typer.Option(
        min=0.001,
        help="Seconds a client has to send a request's headers before the connection "
        "is closed with a 408.",
    ),
]


def pct_text(v: object) -> str:
    """A percentage figure for a report line: two decimals, or "-" where there is none."""
    return "-" if v is None else f"{float(v):.2f} %"  # type: ignore[arg-type]


def open_share(value: float) -> float:
    """Option callback: a share strictly between 0 and 1, such as a coverage (NaN is
    refused too); click names the option, where the model's own check did not."""
    if not 0 < value < 1:
        raise typer.BadParameter(f"must be in (0, 1), got {value:g}")
    return value


def given_options(ctx: typer.Context, *names: str) -> list[str]:
    """The options among ``names`` (parameter names) that the command line set, as
    ``--flags``: an option left at its default says nothing, even where the default is
    a value."""
    # by name: typer carries its own copy of click, whose ParameterSource is not click's
    chosen = ("COMMANDLINE", "ENVIRONMENT")
    return [
        "--" + n.replace("_", "-")
        for n in names
        if getattr(ctx.get_parameter_source(n), "name", None) in chosen
    ]


def refuse_drawing_options(ctx: typer.Context, names: tuple[str, ...]) -> None:
    """For a trace, which brings its own requests and arrival times: an option that would
    draw them (``names``), given on the command line, is refused, where it was ignored in
    silence and recorded in the JSON as a setting of the run."""
    given = given_options(ctx, *names)
    if given:
        raise ValueError(
            f"{', '.join(given)}: a trace file brings its own requests and arrival times; "
            "leave these out, or generate the workload (sharegpt, synthetic)"
        )


def parse_confidence(text: str, option: str) -> float | None:
    """A ``--deadline-confidence`` value as given: ``off`` (None) or a number (its range
    is checked where it is used)."""
    if text == "off":
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{option}: {text!r} is neither off nor a number") from None


def _fail(msg: str) -> NoReturn:
    _error_line(msg)
    raise typer.Exit(2)


def _error_line(msg: str) -> None:
    """The one ``error:`` line every refusal prints on stderr."""
    # escape: a message quotes user input ("run[abc].jsonl"), which rich would read as markup
    err.print(f"[bold red]error:[/] {escape(msg)}", highlight=False)


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
    except MemoryError as e:  # --requests 1e12: numpy names the size it could not allocate
        _fail(f"out of memory: {e or 'the run is too large for this machine'}")
    except OSError as e:  # a path given that cannot be read or written (a directory, /proc)
        if e.filename is None:
            raise
        _fail(f"{e.filename}: {e.strerror or e}")


def progress_display(*, transient: bool = True) -> Any:
    """The commands' rich progress bars on stderr (label, bar, done/total, time), shown
    only on a terminal; ``transient`` ones vanish when done."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    return Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=transient,
        disable=not sys.stderr.isatty(),
    )


def _progress(total: int, label: str) -> tuple[Any, Callable[[int, int], None]]:
    prog = progress_display()
    task = prog.add_task(label, total=total)
    return prog, lambda done, n: prog.update(task, completed=done, total=n)
