"""A command whose reader leaves (`duetime ... | head -1`) still writes its files and
exits as it would have: the console falls silent rather than ending the command."""

from __future__ import annotations

import io
import json
import os
import subprocess
from pathlib import Path

from duetime.cli.console import ReaderSafeConsole
from tests.backend_procs import DUETIME


def run_with_reader_gone(*args: str) -> subprocess.CompletedProcess[bytes]:
    """Run ``duetime ARGS`` with its stdout a pipe whose reading end is closed before
    the command prints anything, as `| true` or an early `| head` leaves it."""
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        return subprocess.run(
            [str(DUETIME), *args], stdout=write_fd, stderr=subprocess.PIPE, timeout=120
        )
    finally:
        os.close(write_fd)


def test_bench_sim_writes_its_json_when_the_reader_has_gone(tmp_path: Path) -> None:
    """`bench sim` prints its line before it writes --json; rich's default exited 1 there."""
    j = tmp_path / "s.json"
    proc = run_with_reader_gone("bench", "sim", "--requests", "300", "--json", str(j))
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"Traceback" not in proc.stderr
    assert json.loads(j.read_text())["requests"] == 300


def test_json_to_a_gone_reader_is_no_traceback() -> None:
    """``--json /dev/stdout | head -1``: the reader leaves after the JSON's first line."""
    proc = run_with_reader_gone(
        *("predict", "throughput", "--input-len", "64", "--output-len", "64", "--batch", "4"),
        *("--json", "/dev/stdout"),
    )
    assert proc.returncode == 0, proc.stderr.decode()
    assert b"Traceback" not in proc.stderr


def test_a_closed_descriptor_is_pointed_at_devnull_and_printing_goes_on() -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    with os.fdopen(write_fd, "w") as stream:
        console = ReaderSafeConsole(file=stream)
        console.print("first")  # EPIPE here
        console.print("second")  # lands in /dev/null
        assert os.path.samestat(os.fstat(write_fd), os.stat(os.devnull))
        assert not console.quiet


class _Gone(io.StringIO):
    """A stream with no descriptor whose reader has gone."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self) -> int:
        raise io.UnsupportedOperation("no descriptor")


def test_a_stream_without_a_descriptor_is_quieted() -> None:
    console = ReaderSafeConsole(file=_Gone())
    console.print("first")
    console.print("second")
    assert console.quiet


def test_figures_sent_to_stdout_leave_it_to_them() -> None:
    """`--json /dev/stdout | jq` read the JSON and then the table: 'Extra data'."""
    proc = subprocess.run(
        [str(DUETIME), "advise", "batch", "--input-len", "64", "--output-len", "16",
         "--deadline", "5", "--json", "/dev/stdout"],
        capture_output=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr.decode()
    assert json.loads(proc.stdout)["bb_safe"] >= 1  # the JSON alone
    assert b"largest batch meeting 5 s" in proc.stderr  # the table, on standard error
