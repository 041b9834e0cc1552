"""Output paths are checked before any work, and error lines print user input as given."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from duetime.cli import app
from duetime.metrics.atomic import atomic_path
from duetime.policies import make_policy
from duetime.server.ports import listening_socket
from duetime.workloads._files import atomic_writer

runner = CliRunner()
SIM = ["sim", "--workload", "synthetic", "--requests", "5"]


def _invoke(*args: str) -> tuple[int, str]:
    """Exit code and output, unfolded from click's error box into one line of words."""
    res = runner.invoke(app, list(args))
    return res.exit_code, " ".join(res.output.replace("│", " ").split())


def test_an_error_line_prints_brackets_as_given(tmp_path: Path) -> None:
    """rich read "run[abc].jsonl" as markup and named "run.jsonl"; "[/]" was a traceback."""
    code, out = _invoke("sim", "--workload", str(tmp_path / "run[abc].jsonl"))
    assert code == 2
    assert "run[abc].jsonl" in out
    code, out = _invoke(*SIM, "--policy", "[/]")
    assert code == 2
    assert "unknown policy '[/]'" in out


def test_an_error_line_prints_a_line_number_not_an_emoji(tmp_path: Path) -> None:
    """rich read ":100:" in "t.jsonl:100: field ..." as the emoji code for 💯."""
    good = '{"rid": %d, "arrival": 0.0, "prompt_len": 4, "output_len": 2}\n'
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(good % i for i in range(99)) + '{"rid": 99}\n')
    code, out = _invoke("sim", "--workload", str(trace))
    assert code == 2
    assert "t.jsonl:100:" in out, out


@pytest.mark.parametrize(
    ("first", "second"), [("--json", "--plot"), ("--json", "--save-trace"), ("--plot", "--json")]
)
def test_one_file_for_two_outputs_is_refused_before_the_run(
    tmp_path: Path, first: str, second: str
) -> None:
    """`--json r.json --plot r.json` wrote the plot over the figures."""
    target = tmp_path / "r.json"
    code, out = _invoke(*SIM, first, str(target), second, str(tmp_path / "." / "r.json"))
    assert code == 2, out
    assert f"is also the {first} file: give each output its own" in out
    assert not target.exists()


@pytest.mark.parametrize("output_first", [False, True])
def test_an_output_over_an_input_is_refused_and_the_input_kept(
    tmp_path: Path, output_first: bool
) -> None:
    """`advise batch --data a.csv --json a.csv` replaced the measurements with the advice."""
    from duetime.predict.ala_data import shipped_dir

    data = tmp_path / "a.csv"
    data.write_bytes((shipped_dir() / "sim-gpu.csv").read_bytes())
    given = [["--data", str(data)], ["--json", str(data)]]
    args = [*given[output_first], *given[not output_first]]
    code, out = _invoke("advise", "batch", "--input-len", "16", "--output-len", "4",
                        "--deadline", "5", *args)  # fmt: skip
    assert code == 2, out
    first, second = ("--json", "--data") if output_first else ("--data", "--json")
    assert f"is also the {first} file: it would be written over" in out, second
    assert data.read_bytes() == (shipped_dir() / "sim-gpu.csv").read_bytes()


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("bench", "predict-length", "--model", "{m}", "--json", "{m}"), "--model"),
        (("bench", "sensitivity", "--learned", "learned:{m}", "--json", "{m}"), "--learned"),
        (("bench", "amin", "--learned", "learned,learned:{m}", "--json", "{m}"), "--learned"),
        (("bench", "timebill", "--predictor", "learned:{m}", "--plot", "{m}"), "--predictor"),
        (("bench", "timebill", "--profile", "{m}", "--json", "{m}"), "--profile"),
        (("bench", "timelyllm", "--engine", "--calibration", "{m}", "--json", "{m}"),
         "--calibration"),
    ],
)  # fmt: skip
def test_a_bench_writes_over_none_of_its_inputs(
    tmp_path: Path, args: tuple[str, ...], named: str
) -> None:
    """predict-length --model M.npz --json M.npz turned the shipped model into JSON."""
    model = tmp_path / "m.npz"
    model.write_bytes(b"the input")
    code, out = _invoke(*(a.replace("{m}", str(model)) for a in args))
    assert code == 2, out
    assert f"is also the {named} file: it would be written over" in out
    assert model.read_bytes() == b"the input"


def test_a_trace_is_not_saved_over_itself(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    assert _invoke(*SIM, "--save-trace", str(trace))[0] == 0
    before = trace.read_text()
    code, out = _invoke("sim", "--workload", str(trace), "--save-trace", str(trace))
    assert code == 2, out
    assert "is also the --workload file" in out
    assert trace.read_text() == before


@pytest.mark.parametrize(
    ("args", "option"),
    [
        (("sim", "--profile", ""), "--profile"),  # was "error: .: Is a directory"
        (("sim", "--workload", " "), "--workload"),  # was read as a trace path
        (("load", "--workload", ""), "--workload"),
        (("sim", "--replica-profile", "a100-llama2-7b", "--replica-profile", ""), "--replica"),
    ],
)  # fmt: skip
def test_a_blank_input_is_refused_by_name(args: tuple[str, ...], option: str) -> None:
    code, out = _invoke(*args)
    assert code == 2, out
    assert f"Invalid value for '{option}" in out
    assert "is empty: give a name or a file" in out


def test_a_blank_path_is_named_as_the_directory_click_reads() -> None:
    """A path option turns '' into '.' before any check sees it."""
    args = ("advise", "batch", "--input-len", "8", "--output-len", "8", "--deadline", "1")
    code, out = _invoke(*args, "--data", "")
    assert code == 2, out
    assert "Invalid value for '--data': '.' is a directory: give a file" in out


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize(
    "args",
    [
        ("predict", "collect-throughput", "--quick", "--out", "/dev/full"),  # appended rows
        ("bench", "deferred-prefill", "--requests", "600", "--workers", "1",
         "--json", "/dev/full"),  # a bench's figures
    ],
)  # fmt: skip
def test_a_full_device_is_one_line_naming_it(args: tuple[str, ...]) -> None:
    """Each was an OSError traceback: ENOSPC names no file, and the bench's write ran
    outside the commands' error handling."""
    code, out = _invoke(*args)
    assert code == 2, out
    assert "Traceback" not in out
    assert "/dev/full: No space left on device" in out


def test_a_device_may_take_several_outputs() -> None:
    code, out = _invoke(*SIM, "--json", os.devnull, "--plot", os.devnull)
    assert code == 0, out


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_an_unwritable_output_is_refused_before_the_run(tmp_path: Path, option: str) -> None:
    a_file = tmp_path / "plain"
    a_file.write_text("x")
    code, out = _invoke(*SIM, option, str(a_file / "r.json"))  # parent is a file
    assert code == 2
    assert "cannot write" in out
    code, out = _invoke(*SIM, option, str(tmp_path))
    assert code == 2
    assert "is a directory" in out
    assert a_file.read_text() == "x"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain"]  # no temporary left


def test_checking_an_output_path_creates_nothing(tmp_path: Path) -> None:
    """The check made the parent directories, so a run that then failed left them."""
    target = tmp_path / "new" / "dir" / "r.json"
    code, out = _invoke(*SIM, "--policy", "bogus", "--json", str(target))
    assert code == 2, out
    assert not (tmp_path / "new").exists()
    code, out = _invoke(*SIM, "--json", str(target))  # a good run creates them
    assert code == 0, out
    assert json.loads(target.read_text())["summary"]["completed"] == 5


def test_a_pipe_given_as_output_is_written_into_not_replaced(tmp_path: Path) -> None:
    """--json /dev/stdout or a FIFO: renaming a temporary over it put a plain file there."""
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # so the writer's open does not block
    try:
        code, out = _invoke(*SIM, "--json", str(fifo))
        assert code == 0, out
        assert stat.S_ISFIFO(fifo.stat().st_mode)
        payload = json.loads(os.read(reader, 1 << 16))
    finally:
        os.close(reader)
    assert payload["summary"]["completed"] == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pipe"]  # no temporary left


def test_atomic_writes_name_the_target_not_their_temporary(tmp_path: Path) -> None:
    a_file = tmp_path / "plain"
    a_file.write_text("x")
    target = a_file / "out.json"
    with (
        pytest.raises(NotADirectoryError, match="plain is not a directory") as info,
        atomic_path(target),
    ):
        pass
    assert info.value.filename == str(target)
    with pytest.raises(IsADirectoryError) as dir_info, atomic_writer(tmp_path):
        pass
    assert dir_info.value.errno == errno.EISDIR
    assert dir_info.value.filename == str(tmp_path)


def test_save_trace_to_an_unwritable_path_names_it(tmp_path: Path) -> None:
    a_file = tmp_path / "plain"
    a_file.write_text("x")
    target = a_file / "t.jsonl"
    code, out = _invoke(*SIM, "--save-trace", str(target))
    assert code == 2
    assert "t.jsonl" in out
    assert ".tmp" not in out


def test_unknown_policy_arguments_are_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"policy 'edf'.*'nope'"):
        make_policy("edf", nope=1)
    code, out = _invoke("serve", "--model", "tiny", "--policy-args", '{"nope": 1}')
    assert code == 2
    assert "'nope'" in out


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_an_unknown_log_level_is_refused(command: str) -> None:
    code, out = _invoke(command, "--log-level", "nope")
    assert code == 2
    assert "--log-level" in out


def test_port_zero_becomes_a_listening_port_the_banner_prints() -> None:
    with listening_socket("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port > 0
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # listening already: a client waits in the backlog while the model loads
        with pytest.raises(ValueError, match=rf"--port {port}: 127\.0\.0\.1:{port} is in use"):
            listening_socket("127.0.0.1", port)


@pytest.mark.parametrize("command", ["serve", "gateway"])
def test_a_port_in_use_and_an_unknown_policy_are_refused_before_the_model_loads(
    command: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`duetime serve --model gemma` on a taken port said so after 2 min 35 s of loading
    and timing the model, exit 3; an unknown policy came after the step timing."""
    import duetime.server.build

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(duetime.server.build, "load_served_model", never)
    with listening_socket("127.0.0.1", 0) as taken:
        port = str(taken.getsockname()[1])
        extra = ["--backend", "http://127.0.0.1:9"] if command == "gateway" else []
        code, out = _invoke(command, "--port", port, *extra)
        assert code == 2, out
        assert f"--port {port}: 127.0.0.1:{port} is in use" in out
    if command == "serve":
        code, out = _invoke("serve", "--policy", "nope", "--port", "0")
        assert code == 2, out
        assert "unknown policy 'nope'" in out
    with pytest.raises(ValueError, match=r"--host no\.such\.host\.invalid: not an address"):
        listening_socket("no.such.host.invalid", 0)


def test_help_shows_bracketed_defaults() -> None:
    """Help texts are plain: rich markup read "[a100-llama2-7b]" as a tag and dropped it."""
    code, output = _invoke("bench", "amin", "--help")
    assert code == 0, output
    assert "[a100-llama2-7b]" in output
    code, output = _invoke("bench", "timebill", "--help")
    assert "[noisy; --engine: learned]" in " ".join(output.split())
