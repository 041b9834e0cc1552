"""Real-engine commands print what they ran: tables a pipe (80 columns) does not cut,
small budgets named exactly, and the number of requests `profile --quick` really serves.

Each case here once printed a table a pipe cut or said something the run did not do.
The numbered sections are the rest of those in tests/test_bench_engine_refusals.py.
"""

from __future__ import annotations

import contextlib
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from typer.testing import CliRunner

from duetime.cli import app
from tests.bench_checks_commands import TB

runner = CliRunner()


def _invoke(*args: str) -> tuple[int, str]:
    res = runner.invoke(app, list(args))
    return res.exit_code, res.output


# --- 8. tables at 80 columns (a pipe) keep their key columns -------------------------------
def _render(table: Any, width: int = 80) -> str:
    buf = io.StringIO()
    Console(file=buf, width=width, emoji=False).print(table)
    return buf.getvalue()


def test_deferred_prefill_engine_table_keeps_k_at_80_columns() -> None:
    """The K column vanished and every header was cut ("real tok…")."""
    from duetime.bench.deferred_prefill_engine import table

    ks = (1, 2, 12)
    fig = {
        "engine": {"model": "tiny, fp32, 1 thread(s), cpu clock"},
        "capacity": 16,
        "workload": {"prompt_tokens": 16},
        "requests": 80,
        "analytic": [{"k": k, "throughput_req_s": 21.718} for k in ks],
        "simulated": [{"k": k, "throughput_req_s": 19.854, "completion_mean_s": 10.08} for k in ks],
        "real": [
            {
                "k": k,
                "throughput_req_s": 18.123,
                "throughput_vs_sim_pct": -11.8,
                "throughput_tok_s": 1939.0,
                "completion_mean_s": 10.09,
            }
            for k in ks
        ],
    }
    text = _render(table(fig))
    assert "…" not in text
    first = [line.split("│")[1].strip() for line in text.splitlines() if line.startswith("│")]
    assert first == ["1", "2", "12"]
    assert "tok/s" in text
    assert "21.718" in text


def test_amin_engine_table_keeps_interval_names_at_80_columns() -> None:
    """Every construction showed as "overl…"."""
    from duetime.bench.amin_engine import table

    side = {"tel_s": 1234.4, "tel_ratio_vs_hsf": 1.234, "restarts": 13, "kv_peak_tokens": 224}
    names = ("overlap-0.95", "overlap-0.99", "overlap-0.1")
    rows = [{"policy": "hsf", "construction": "oracle"}]
    rows += [{"policy": p, "construction": c} for c in names for p in ("amax", "amin")]
    for r in rows:
        r.update(real=dict(side), sim=dict(side), tel_sim_vs_real_pct=-3.0)
    fig = {"workload": {"requests": 12}, "kv_capacity_tokens": 224, "rows": rows,
           "engine": {"model": "tiny, fp32, 1 thread(s), cpu clock"}}  # fmt: skip
    text = _render(table(fig))
    assert "…" not in text
    for c in names:
        assert text.count(f" {c} ") == 2, text
    assert max(len(line) for line in text.splitlines()) <= 80


# --- 9. timebill --engine: small budgets in the table header --------------------------------
def test_timebill_engine_table_names_small_budgets_exactly(tmp_path: Path) -> None:
    """0.004 / 0.006 / 0.008 s printed as T=0.00 | T=0.01 | T=0.01."""
    out = tmp_path / "x.json"
    code, output = _invoke(*TB, "--budget", "0.004", "--budget", "0.006", "--budget", "0.008",
                           "--threads", "1", "--json", str(out),
                           "--plot", str(tmp_path / "x.png"))  # fmt: skip
    assert code == 0, output
    from duetime.bench.timebill_engine_report import table

    text = "".join(_render(t, width=200) for t in table(json.loads(out.read_text())))
    for b in ("T=0.004", "T=0.006", "T=0.008"):
        assert b in text, text


# --- 12. profile --quick: say how many requests really serve ---------------------------------
def test_profile_quick_says_how_many_requests_it_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Printed "serving 40 ShareGPT requests" and served 4."""
    import duetime.cli.engine as cli_engine
    import duetime.engine
    import duetime.engine.profile
    from duetime.engine.testing import engine_from_hf, tiny_hf_model

    served: list[int] = []
    said: list[str] = []

    def serving_steps(model: Any, *, requests: int, **kwargs: Any) -> list[Any]:
        served.append(requests)
        return []

    @contextlib.contextmanager
    def status(msg: str) -> Iterator[None]:
        said.append(msg)
        yield

    monkeypatch.setattr(duetime.engine, "load_model", lambda **kw: engine_from_hf(tiny_hf_model()))
    monkeypatch.setattr(duetime.engine.profile, "serving_steps", serving_steps)
    monkeypatch.setattr(cli_engine.console, "status", status)
    code, output = _invoke("profile", "--quick", "--serve-requests", "40", "--threads", "1",
                           "--out", str(tmp_path / "p.json"))  # fmt: skip
    assert code == 0, output
    assert served == [4]
    serving = [m for m in said if m.startswith("serving")]
    assert len(serving) == 1, said
    assert "serving 4 " in serving[0], said
    assert "40 asked" in serving[0], said
    assert any("noise floor" in m for m in said), said
