"""`duetime profile --url`: the black-box branch of `duetime profile` (no engine loaded).

Kept out of :mod:`duetime.cli.engine`, whose `profile` only hands over here, so
that probing a remote server never imports torch or the embedded engine.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from duetime.cli.common import _fail, _progress, _user_errors, pct_text
from duetime.cli.common import out as console

if TYPE_CHECKING:
    from duetime.cli.profile_engine import EngineLimits


def profile_url(
    url: str,
    *,
    model: str | None,
    quick: bool,
    out: Path,
    json_path: Path | None,
    limits: EngineLimits,
    timeout_s: float,
) -> None:
    """Probe ``url``, fit, write the profile to ``out`` and print the held-out MAPE."""
    from duetime.metrics import write_json
    from duetime.predict.cost_report import profile_payload
    from duetime.server.probe_http import ProbeError
    from duetime.server.probe_profile import ProbeGrid, probe_server, run_probes, source_line

    grid = ProbeGrid.quick() if quick else ProbeGrid()
    t0 = time.perf_counter()
    try:
        with console.status(f"asking {url} what it serves"):
            info, per_word, measured = probe_server(url, model, timeout_s)
        prog, cb = _progress(1, f"probing {info.model}")
        with prog:
            run = run_probes(info, grid, per_word, measured, progress=cb, timeout_s=timeout_s)
    except ProbeError as e:
        _fail(str(e))
    measure_s = time.perf_counter() - t0
    if len(run.samples) < 8:
        _fail(
            f"{url}: only {len(run.samples)} steps could be timed ({run.skipped_windows} "
            "decode windows too short); the server may cap its batch below the grid's "
            "concurrencies or stop answers early"
        )
    with _user_errors():
        payload = profile_payload(
            run.samples,
            name=f"{info.model}-black-box",
            source=source_line(run, url),
            **limits,
            regimes=None,
            noise_floor_pct=run.noise_floor_pct,
            noise=run.noise,
        )
        payload["probe"] = {
            "url": url,
            "model": info.model,
            "ignore_eos": "ignore_eos" in info.extras,
            "usage_reported": "stream_options" in info.extras,
            "tokens_per_word": per_word,
            "requests": run.requests,
            "skipped_windows": run.skipped_windows,
            "grid": {
                "prompts": list(grid.prompts),
                "concurrencies": list(grid.concurrencies),
                "output_tokens": grid.output_tokens,
                "reps": grid.reps,
            },
        }
        write_json(out, payload)
    held = payload["heldout"]
    assert isinstance(held, dict)
    report: dict[str, Any] = {
        "profile": str(out),
        "url": url,
        "model": info.model,
        "measure_s": measure_s,
        "samples": len(run.samples),
        "requests": run.requests,
        "ignore_eos": "ignore_eos" in info.extras,
        **{k: held[k] for k in held if k.endswith("_pct")},
        "noise_floor_pct": payload["noise_floor_pct"],
        "verdict": payload["verdict"],
        "at_noise_limit": payload["at_noise_limit"],
        "misses": payload["misses"],
    }
    eos = "" if report["ignore_eos"] else " (the server refused ignore_eos: answers may be short)"
    console.print(
        f"probed {info.model} at {url}: {len(run.samples)} steps from {run.requests} "
        f"requests in {measure_s:.1f} s{eos}\n"
        f"held-out MAPE, step-cost model: all {pct_text(held['batch_model_mape_pct'])}, prompts "
        f"{pct_text(held['model_prefill_mape_pct'])}, "
        f"decodes {pct_text(held['model_decode_mape_pct'])}"
        f"\n{payload['verdict']}",
        highlight=False,
    )
    if json_path is not None:
        write_json(json_path, report)
    console.print(f"wrote {out}" + ("" if json_path is None else f", {json_path}"))
