"""The serve-peers table reads both clients' JSON as they write it and puts the right numbers in
the right cells: vLLM bench serve's ms figures as they are, duetime load's seconds as ms."""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

import pytest

from duetime.bench import serve_peers_table as spt


def _vllm(completed: int, tok_s: float, ttft50: float, ttft99: float, tpot50: float) -> dict:
    # the keys vLLM 0.32's --save-result writes (a subset; the rest is ignored)
    return {
        "num_prompts": completed,
        "completed": completed,
        "duration": 12.5,
        "output_throughput": tok_s,
        "median_ttft_ms": ttft50,
        "p99_ttft_ms": ttft99,
        "median_tpot_ms": tpot50,
        "p99_tpot_ms": tpot50 * 2,
    }


def _load(ok: int, sent: int, tok_s: float, ttft50: float, ttft99: float, tbt50: float) -> dict:
    row = {
        "run": "1/s",
        "rate_req_s": 1.0,
        "sent": sent,
        "ok": ok,
        "throughput_tok_s": tok_s,
        "ttft_p50_s": ttft50,
        "ttft_p99_s": ttft99,
        "tbt_p50_s": tbt50,
    }
    return {"config": {}, "rows": [row]}


def _write(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))


@pytest.fixture
def results(tmp_path: Path) -> Path:
    _write(tmp_path / "duetime" / "vllm-bench-rate-inf.json", _vllm(100, 158.04, 30226, 77027, 177))
    _write(tmp_path / "duetime" / "vllm-bench-rate-1.json", _vllm(60, 111.2, 346.4, 895, 75.3))
    _write(
        tmp_path / "duetime" / "duetime-load-rate-1.json", _load(59, 60, 110.5, 0.35, 0.9, 0.0751)
    )
    _write(tmp_path / "vllm" / "vllm-bench-rate-4.json", _vllm(80, 172.0, 875, 4869, 349))
    (tmp_path / "duetime" / "server.log").write_text("not a result")
    run = {
        "command": "bash scripts/serve_peers.sh",
        "load": "256 in / 128 out",
        "servers": {"vllm": "vllm serve m", "duetime": "duetime serve --model gemma"},
    }
    _write(tmp_path / "run.json", run)
    return tmp_path


def test_rows_in_server_then_client_then_rate_order(results: Path) -> None:
    rows = spt.read_rows(results, ["vllm", "duetime"])
    got = [(r.server, r.client, r.rate) for r in rows]
    assert got == [
        ("vllm", "vllm-bench", "4"),
        ("duetime", "vllm-bench", "1"),
        ("duetime", "vllm-bench", "inf"),
        ("duetime", "duetime-load", "1"),
    ]
    load = rows[-1]
    assert (load.ok, load.sent, load.out_tok_s) == (59, 60, 110.5)
    assert load.ttft_p50_ms == pytest.approx(350.0)
    assert load.ttft_p99_ms == pytest.approx(900.0)
    assert load.tpot_p50_ms == pytest.approx(75.1)


def test_default_servers_are_the_subdirectories(results: Path) -> None:
    assert [r.server for r in spt.read_rows(results)] == ["duetime"] * 3 + ["vllm"]


def test_table_cells(results: Path) -> None:
    rows = spt.read_rows(results, ["duetime", "vllm"])
    text = spt.render(rows, "Machine: X, 2 cores, 2025-01-01.", None)
    lines = text.splitlines()
    assert lines[0] == "Machine: X, 2 cores, 2025-01-01."
    assert "| duetime | vllm-bench | 1 | 60 / 60 | 111.2 | 346 / 895 | 75 |" in lines
    assert "| duetime | vllm-bench | inf | 100 / 100 | 158.0 | 30,226 / 77,027 | 177 |" in lines
    assert "| duetime | duetime-load | 1 | 59 / 60 | 110.5 | 350 / 900 | 75 |" in lines
    assert "| vllm | vllm-bench | 4 | 80 / 80 | 172.0 | 875 / 4,869 | 349 |" in lines


def test_missing_percentile_prints_a_dash() -> None:
    d = _vllm(5, 10.0, 1.0, 2.0, 3.0)
    del d["p99_ttft_ms"]
    row = spt.from_vllm_bench("llama", "1", d)
    assert "| 1 / - | 3 |" in spt.render([row], "m")


def test_main_writes_table_md_with_the_run_and_machine(
    results: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert spt.main([str(results)]) == 0
    text = (results / "table.md").read_text()
    assert text == capsys.readouterr().out
    assert text.startswith("Machine: ")
    assert "Command: `bash scripts/serve_peers.sh`" in text
    assert "- vllm: `vllm serve m`" in text
    # run.json lists vllm first, so its rows come first
    assert text.index("| vllm |") < text.index("| duetime |")


def test_machine_line_names_cores_and_date() -> None:
    line = spt.machine_line(dt.date(2025, 3, 4))
    assert line.startswith("Machine: ")
    assert " cores, 2025-03-04." in line


def test_bad_inputs_fail_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert spt.main([str(tmp_path / "absent")]) == 2
    assert spt.main([str(tmp_path)]) == 1
    assert "no result files" in capsys.readouterr().err
    _write(tmp_path / "llama" / "duetime-load-rate-1.json", {"config": {}, "rows": []})
    assert spt.main([str(tmp_path)]) == 1
    assert "llama duetime-load rate 1: no rows" in capsys.readouterr().err
    (tmp_path / "llama" / "duetime-load-rate-1.json").write_text("{")
    assert spt.main([str(tmp_path)]) == 1
    assert "not readable JSON" in capsys.readouterr().err
