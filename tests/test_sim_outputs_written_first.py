"""`sim`, `sweep`, `demo` and `bench fleet` write their files before they print, a write
that fails is one line naming the file, and a run that fails leaves no trace file."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from duetime.cli import app, common
from duetime.metrics.atomic import atomic_path

runner = CliRunner()
SIM = ("sim", "--workload", "synthetic", "--requests", "8")


def _invoke(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, list(args))
    return res.exit_code, " ".join(res.output.replace("│", " ").split())


def _closed_stdout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every table or line the commands print fails as it does under `| head -1`."""

    def broken(*args: Any, **kwargs: Any) -> None:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")

    monkeypatch.setattr(common.out, "print", broken)


# --- a full disk ------------------------------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
def test_a_full_device_is_one_line_naming_it() -> None:
    code, out = _invoke(*SIM, "--json", "/dev/full")
    assert code == 2, out
    assert "Traceback" not in out
    assert "/dev/full: No space left on device" in out


def test_a_failed_write_names_the_target_and_leaves_nothing(tmp_path: Path) -> None:
    """ENOSPC while writing names no file; the error must name the output asked for."""
    target = tmp_path / "r.json"
    target.write_text("old")

    def fill(tmp: str) -> None:
        Path(tmp).write_text("half")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError, match="No space left") as info, atomic_path(target) as tmp:
        fill(tmp)
    assert info.value.filename == str(target)
    assert info.value.errno == errno.ENOSPC
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.json"]  # no temporary left


def test_a_full_disk_under_sim_json_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import duetime.metrics.output as output

    class Full:
        """A file on a full disk: every write fails, as ENOSPC does, naming no file."""

        def __init__(self, path: str, *args: Any, **kwargs: Any) -> None:
            self.path = path

        def __enter__(self) -> Full:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def write(self, text: str) -> int:
            Path(self.path).write_text(text[:3])  # half a file on disk
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(output, "open", Full, raising=False)
    target = tmp_path / "r.json"
    code, out = _invoke(*SIM, "--json", str(target))
    assert code == 2, out
    assert "Traceback" not in out
    assert f"{target}: No space left on device" in out
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temporary


# --- the files before the table ---------------------------------------------------------
def test_sim_writes_its_files_before_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _closed_stdout(monkeypatch)
    j, png, trace = tmp_path / "r.json", tmp_path / "r.png", tmp_path / "t.jsonl"
    runner.invoke(app, [*SIM, "--json", str(j), "--plot", str(png), "--save-trace", str(trace)])
    assert json.loads(j.read_text())["summary"]["completed"] == 8
    assert png.stat().st_size > 0
    assert len(trace.read_text().splitlines()) == 8


def test_a_fleet_sim_writes_its_files_before_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _closed_stdout(monkeypatch)
    j, trace = tmp_path / "r.json", tmp_path / "t.jsonl"
    runner.invoke(app, [*SIM, "--replicas", "2", "--json", str(j), "--save-trace", str(trace)])
    assert len(json.loads(j.read_text())["replicas"]) == 2
    assert len(trace.read_text().splitlines()) == 8


def test_sweep_writes_its_files_before_the_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _closed_stdout(monkeypatch)
    j, png = tmp_path / "s.json", tmp_path / "s.png"
    args = ["sweep", "--policies", "fcfs", "--rates", "4", "--workload", "synthetic"]
    runner.invoke(app, [*args, "--requests", "8", "--workers", "1", "--json", str(j)])
    assert len(json.loads(j.read_text())["rows"]) == 1
    runner.invoke(app, [*args, "--requests", "8", "--workers", "1", "--plot", str(png)])
    assert png.stat().st_size > 0


def test_demo_writes_its_files_before_the_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _closed_stdout(monkeypatch)
    runner.invoke(app, ["demo", "--requests", "8", "--out", str(tmp_path)])
    written = json.loads((tmp_path / "demo.json").read_text())
    assert [r["policy"] for r in written["rows"]] == ["fcfs", "edf"]
    # what each run was, as `sweep --json` records it
    assert [(s["policy"], s["rate"], s["deadline_scale"]) for s in written["specs"]] == [
        ("fcfs", 16.0, 8.0),
        ("edf", 16.0, 8.0),
    ]
    assert (tmp_path / "demo.png").stat().st_size > 0


# --- a failed run leaves no trace file --------------------------------------------------
def test_a_run_that_fails_leaves_no_saved_trace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import duetime.experiment

    def fails(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("the run failed")

    monkeypatch.setattr(duetime.experiment, "run_planned", fails)
    trace = tmp_path / "t.jsonl"
    code, out = _invoke(*SIM, "--save-trace", str(trace))
    assert code == 2, out
    assert "the run failed" in out
    assert not trace.exists()


def test_learned_on_a_workload_without_prompts_is_refused_in_cli_terms(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"
    code, out = _invoke(*SIM, "--predictor", "learned", "--save-trace", str(trace))
    assert code == 2, out
    assert "Request.prompt_text" not in out
    assert "build_jobs" not in out
    assert "--predictor learned" in out
    assert "only the sharegpt and sharegpt-heldout workloads carry prompts" in out
    assert "synthetic and trace files do not" in out
    assert not trace.exists()


def test_a_policy_default_learned_predictor_is_named_as_the_policys() -> None:
    from duetime.experiment import SimSpec, check_predictor_workload

    check_predictor_workload("learned", SimSpec(workload="sharegpt-heldout"))  # has prompts
    check_predictor_workload("oracle", SimSpec(workload="synthetic"))  # reads no prompt
    with pytest.raises(ValueError, match=r"hsf's predictor learned:x\.npz reads"):
        check_predictor_workload("learned:x.npz", SimSpec(policy="hsf", workload="synthetic"))


@pytest.mark.parametrize(
    "args",
    [
        ("deferred-prefill", "--capacity", "8", "--mean-output", "50"),
        ("batch", "--input-len", "512", "--output-len", "128", "--deadline", "10"),
    ],
)
def test_advise_writes_its_json_before_the_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...]
) -> None:
    _closed_stdout(monkeypatch)
    j = tmp_path / "a.json"
    runner.invoke(app, ["advise", *args, "--json", str(j)])
    assert json.loads(j.read_text())


def test_bench_fleet_writes_its_json_before_the_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import duetime.bench.fleet

    row = {"fleet": "homogeneous", "load_pct": 85, "router": "lor"}
    fig: dict[str, Any] = {"capacity_req_s": {"homogeneous": 1.0}, "rows": [row]}
    monkeypatch.setattr(duetime.bench.fleet, "run", lambda **kwargs: fig)
    _closed_stdout(monkeypatch)
    j = tmp_path / "f.json"
    runner.invoke(app, ["bench", "fleet", "--json", str(j)])
    assert json.loads(j.read_text())["rows"][0]["router"] == "lor"


def test_a_plot_is_written_in_the_format_its_name_asks_for(tmp_path: Path) -> None:
    """`--plot x.pdf` held PNG bytes; a name matplotlib has no writer for stays PNG."""
    from matplotlib.figure import Figure

    from duetime.metrics.atomic import save_png

    heads = {"pdf": b"%PDF", "svg": b"<?xml", "png": b"\x89PNG", "plot": b"\x89PNG"}
    for suffix, head in heads.items():
        fig = Figure()
        fig.add_subplot().plot([1, 2])
        path = save_png(fig, tmp_path / f"p.{suffix}")
        assert path.read_bytes().startswith(head), suffix
