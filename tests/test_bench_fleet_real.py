"""`duetime bench fleet-real`: a real gateway fleet of tiny-model backends beside the
simulated fleet, its comparison, its refusals, and that it leaves no process behind."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import threading
from collections import Counter
from pathlib import Path

import httpx
import psutil
import pytest
from typer.testing import CliRunner

from duetime.bench.fleet_real_compare import compare
from duetime.bench.fleet_real_procs import FleetStartError, LocalProcesses
from duetime.cli import app
from duetime.core.record import RequestRecord
from duetime.core.request import Request
from duetime.server.ports import free_port
from tests.factories import cli_refused

TINY = ["--model", "tiny", "--max-num-seqs", "4", "--max-batch-tokens", "128"]


def _duetime_children() -> list[psutil.Process]:
    """This test process's descendants that run duetime (backends, gateways)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if "duetime" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _answers(url: str) -> bool:
    try:
        httpx.get(url + "/health", timeout=1.0, trust_env=False)
    except httpx.HTTPError:
        return False
    return True


def _record(rid: int, e2e: float | None, deadline: float | None = None) -> RequestRecord:
    r = RequestRecord(request=Request(rid=rid, arrival=10.0, prompt_len=4, deadline=deadline))
    if e2e is not None:
        r.first_token = r.finish = 10.0 + e2e
    else:
        r.cancelled_at = 10.0
    return r


def test_compare_pairs_requests_by_id_and_measures_relative_error() -> None:
    real = [_record(1, 1.0, 11.5), _record(2, 2.0, 11.5), _record(3, 4.0, 20.0)]
    # sim: 1 half again as long, 2 half as long, 3 refused (not matched)
    sim = [_record(2, 1.0, 11.5), _record(1, 1.5, 11.5), _record(3, None, 20.0)]
    figures, pairs = compare(real, sim)
    assert figures["matched"] == 2
    assert [p["rid"] for p in pairs] == [1, 2]
    assert figures["e2e_rel_err_p50_pct"] == pytest.approx(50.0)
    assert figures["e2e_rel_bias_p50_pct"] == pytest.approx(0.0)  # +50 % and -50 %
    assert figures["hit_rate_real"] == pytest.approx(2 / 3)  # request 2 finished late
    assert figures["hit_rate_sim"] == pytest.approx(2 / 3)  # request 3 refused
    assert figures["hit_rate_gap_points"] == pytest.approx(0.0)


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--routers", "forecast,nope"], "nope"),
        (["--routers", "lor,lor"], "--routers names a router twice"),
        (["--routers", ","], "--routers is empty"),
        (["--rate", "0"], "--rate"),
        (["--rate", "nan"], "--rate"),
        (["--load", "3"], "--load"),
        (["--workload", "trace.jsonl"], "--workload"),
        (["--class-mix", "vip=1"], "--deadline vip=SECONDS"),
        (["--deadline", "vip=2"], "--deadline names class 'vip'"),
        (["--deadline", "0"], "--deadline"),
        (["--prompt-len", "9-3"], "--prompt-len"),
        (["--max-num-seqs", "64", "--max-batch-tokens", "32"], "--max-batch-tokens 32"),
        (["--policy", "nope"], "nope"),
        (["--external", "nope"], "--external 'nope' must be URL=PROFILE.json"),
        (["--external", "http://127.0.0.1:9=/nonexistent.json"], "not a usable profile"),
    ],
)
def test_bad_options_are_refused_before_any_process_starts(args: list[str], names: str) -> None:
    cli_refused("bench", "fleet-real", "--model", "tiny", *args, names=names)
    assert _duetime_children() == []


def test_a_backend_that_does_not_start_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a model")
    out = cli_refused(
        "bench", "fleet-real", "--model", str(bad), "--requests", "2",
        names="backend http://127.0.0.1:",
    )  # fmt: skip
    assert "exited with code" in out
    assert "too short to be a GGUF file" in out
    assert _duetime_children() == []


def test_processes_end_on_error_and_on_sigterm(tmp_path: Path) -> None:
    """A gateway over a backend that is not there keeps running: it must still be ended."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("a SIGTERM handler can only be set on the main thread")

    def start(procs: LocalProcesses) -> subprocess.Popen[bytes]:
        port = free_port()
        args = ["gateway", "--backend", "http://127.0.0.1:9", "--port", str(port)]
        return procs.start("gateway", args, port).proc

    before = signal.getsignal(signal.SIGTERM)
    held: list[subprocess.Popen[bytes]] = []

    def fail(procs: LocalProcesses) -> None:
        held.append(start(procs))
        raise RuntimeError("boom")

    def terminated(procs: LocalProcesses) -> None:
        held.append(start(procs))
        os.kill(os.getpid(), signal.SIGTERM)
        held[-1].wait(30)  # the handler raises before this returns

    # the error leaves the fleet's block (pytest.raises is outside it)
    with pytest.raises(RuntimeError, match="boom"), LocalProcesses(tmp_path) as procs:
        fail(procs)
    with pytest.raises(SystemExit) as exit_, LocalProcesses(tmp_path) as procs:
        terminated(procs)
    assert exit_.value.code == 128 + signal.SIGTERM
    assert all(proc.poll() is not None for proc in held)
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


@pytest.mark.slow
def test_fleet_real_on_tiny_backends(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "fleet.json", tmp_path / "fleet.png"
    routers = ["forecast", "lor", "round-robin"]
    args = ["bench", "fleet-real", *TINY, "--replicas", "2", "--requests", "10"]
    args += ["--prompt-len", "8-16", "--output-len", "8-16", "--routers", ",".join(routers)]
    args += ["--json", str(out_json), "--plot", str(out_png)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    printed = " ".join(res.output.split())  # rich wraps lines at the terminal's width
    assert "estimated from the backends' published profiles" in printed, printed
    fig = json.loads(out_json.read_text())
    assert [run["router"] for run in fig["runs"]] == routers
    assert fig["rate_chosen"]
    assert fig["rate_req_s"] == pytest.approx(0.8 * fig["capacity_req_s"])
    assert set(fig["deadlines_s"]) == {"interactive", "standard", "batch"}
    for run in fig["runs"]:
        for side in ("real", "sim", "sim_warmup"):
            row = run[side]
            assert row["requests"] == 10, (side, row)
            assert 0.0 <= row["deadline_hit_rate"] <= 1.0
        assert run["real"]["errors"] == 0, run["real"]["first_error"]
        c = run["compare"]
        assert c["matched"] >= 1
        for key in ("e2e_rel_err_p50_pct", "e2e_rel_err_p90_pct", "e2e_rel_bias_p50_pct"):
            assert math.isfinite(c[key]), (key, c)
        assert 0.0 <= c["e2e_rel_err_p50_pct"] <= c["e2e_rel_err_p90_pct"]
        assert 0.0 <= c["hit_rate_real"] <= 1.0
        assert 0.0 <= c["hit_rate_sim"] <= 1.0
        gap = 100.0 * (c["hit_rate_sim"] - c["hit_rate_real"])
        assert c["hit_rate_gap_points"] == pytest.approx(gap)
        assert len(run["pairs"]) == c["matched"]
        assert 0 <= run["real"]["refused_by_backends"] <= run["real"]["refused"]
        assert 0.0 <= c["routed_alike"] <= 1.0
        if run["router"] == "round-robin":
            # the k-th request to replica k mod 2: in the simulator exactly; through the
            # gateway two requests a fraction of a ms apart may be taken in either order
            sim_routes = {int(rid): i for rid, i in run["routes"]["sim"].items()}
            assert sim_routes == {rid: rid % 2 for rid in range(10)}
            real_counts = Counter(run["routes"]["real"].values())
            assert sorted(real_counts.values()) == [5, 5], run["routes"]
        assert run["profiles_after"][0]["origin"]["kind"] == "online fit"
    assert fig["profiles_warmup"][0]["origin"]["steps"] >= 16
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # nothing it started is left: no child process, and nothing answers at the backends
    assert _duetime_children() == []
    assert not any(_answers(url) for url in fig["backends"])


def _listing(models: list[dict[str, object]]) -> httpx.Client:
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"object": "list", "data": models})

    return httpx.Client(transport=httpx.MockTransport(answer))


def test_an_external_backend_must_serve_the_fleets_model() -> None:
    """The gateway routes by the model's name: a vLLM serving it under another name would
    take no request, and one with a shorter context would refuse some with a 400."""
    from duetime.bench.fleet_real_live import check_external

    url = "http://127.0.0.1:9"
    with _listing([{"id": "gemma3-270m", "max_model_len": 2048}]) as client:
        with pytest.raises(FleetStartError, match="--served-model-name gemma-3-270m"):
            check_external(client, [url], "gemma-3-270m", 1024)
        check_external(client, [url], "gemma3-270m", 1024)
    with (
        _listing([{"id": "m", "max_model_len": 512}]) as client,
        pytest.raises(FleetStartError, match="--max-model-len 1024"),
    ):
        check_external(client, [url], "m", 1024)


@pytest.mark.slow
def test_an_external_backend_joins_the_fleet_priced_by_its_given_profile(tmp_path: Path) -> None:
    """A backend the run does not start (here a tiny `duetime serve` standing in for a vLLM)
    takes its share of the trace, and its given profile, not its published one, prices it
    on the simulated side; the run leaves it running."""
    from duetime.core.cost import LinearStepCost

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    profile = {
        **LinearStepCost.batch(c=0.003, a=0.0001, b=0.0005, d=0.0).to_profile(),
        "name": "given-probe",
        "max_num_seqs": 4,
        "kv_capacity_tokens": 4096,
    }
    path = tmp_path / "external.json"
    path.write_text(json.dumps(profile))
    with LocalProcesses(tmp_path) as procs:
        ext = procs.start("backend", ["serve", *TINY, "--port", str(port), "--threads", "1"], port)
        procs.wait_healthy(ext, 300.0)
        out_json = tmp_path / "fleet.json"
        args = ["bench", "fleet-real", *TINY, "--replicas", "1", "--requests", "6"]
        args += ["--prompt-len", "8-16", "--output-len", "8-16", "--routers", "round-robin"]
        args += ["--external", f"{url}={path}", "--json", str(out_json)]
        res = CliRunner().invoke(app, args)
        assert res.exit_code == 0, res.output
        assert ext.proc.poll() is None  # not the run's to end
        assert _answers(url)
    fig = json.loads(out_json.read_text())
    assert fig["replicas"] == 2
    assert fig["external"] == [url]
    assert fig["backends"][1] == url
    assert fig["profiles_warmup"][1]["name"] == "given-probe"
    (run,) = fig["runs"]
    assert run["real"]["errors"] == 0, run["real"]["first_error"]
    assert sorted(Counter(run["routes"]["real"].values()).values()) == [3, 3], run["routes"]
    assert run["profiles_after"][1]["name"] == "given-probe"


@pytest.mark.parametrize(
    ("deadlines", "classes"),
    [({"interactive": 1.0}, {"interactive", "standard", "batch"}), ({"default": 5.0}, {"default"})],
)
def test_a_deadline_alone_takes_the_default_classes(
    deadlines: dict[str, float], classes: set[str]
) -> None:
    """--deadline interactive=1 without --class-mix was refused: 'no request can have'
    the class the default mix has; a deadline for the one default class still works."""
    from duetime.bench.fleet_real import _mix
    from duetime.bench.fleet_real_live import FleetRealConfig

    cfg = FleetRealConfig(deadlines=deadlines, requests=60)
    plan = cfg.trace(class_mix=_mix(cfg), deadlines=cfg.deadlines).build(1.0)
    assert {r.klass for r in plan} == classes
