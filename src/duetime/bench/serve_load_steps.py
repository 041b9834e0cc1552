"""A served engine's rounds summed up, and set beside the offline engine's steps.

Decode-only steps are grouped in bands of running batch size (powers of two:
1, 2-3, 4-7, ...); a band's served forward pass (median) is compared with the
offline replay's in the same band. Steps with a prefill chunk are summed apart:
their time depends on the chunk far more than on the batch.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from duetime.server.step_log import PARTS, StepRow

__all__ = ["band_of", "served_summary", "steps_by_band"]


def band_of(decoders: int) -> str:
    """``"1"``, ``"2-3"``, ``"4-7"``, ``"8-15"``, ...: the power-of-two band of a batch."""
    if decoders < 1:
        raise ValueError(f"a decode batch has at least one sequence, got {decoders}")
    lo = 1 << (decoders.bit_length() - 1)
    hi = 2 * lo - 1
    return str(lo) if lo == hi else f"{lo}-{hi}"


def served_summary(rows: Sequence[StepRow]) -> dict[str, Any]:
    """Where the engine thread's time went over the run (seconds and shares per part),
    the number of steps, and the running batch averaged over the forward time."""
    if not rows:
        return {"rounds": 0, "steps": 0}
    totals = {p: sum(getattr(r, p) for r in rows) for p in PARTS}
    busy = [r for r in rows if r.stepped]
    # the rounds from the first step to the last (idle before and after is no load)
    if busy:
        first = rows.index(busy[0])
        last = len(rows) - 1 - rows[::-1].index(busy[-1])
        span = rows[first : last + 1]
        totals = {p: sum(getattr(r, p) for r in span) for p in PARTS}
    wall = sum(totals.values())
    fwd = sum(r.forward for r in busy)
    mean_batch = sum(r.decoders * r.forward for r in busy) / fwd if fwd > 0 else None
    return {
        "rounds": len(rows),
        "steps": len(busy),
        "prefill_steps": sum(1 for r in busy if r.prefill_tokens > 0),
        "mean_running_batch": mean_batch,
        **{f"{p}_s": totals[p] for p in PARTS},
        **{f"{p}_share": totals[p] / wall if wall > 0 else None for p in PARTS},
        "round_overhead_ms_per_step": (
            1000 * (wall - totals["forward"] - totals["idle"]) / len(busy) if busy else None
        ),
    }


def _median_ms(xs: Sequence[float]) -> float | None:
    return 1000 * statistics.median(xs) if xs else None


def steps_by_band(
    served: Sequence[StepRow], offline: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Per decode-batch band: served steps (forward and whole round, median ms), the
    offline replay's steps in the same band, and the served forward over the offline.
    ``offline`` rows are the executor's telemetry (``step_s``, ``prefill_tokens``,
    ``decode_seqs``)."""
    bands: dict[str, dict[str, list[float]]] = {}

    def slot(band: str) -> dict[str, list[float]]:
        return bands.setdefault(band, {"fwd": [], "round": [], "off": [], "d": []})

    for r in served:
        if r.decoders > 0 and r.prefill_tokens == 0:
            b = slot(band_of(r.decoders))
            b["fwd"].append(r.forward)
            b["round"].append(r.drain + r.schedule + r.forward + r.deliver + r.refresh)
            b["d"].append(r.decoders)
    for s in offline:
        d = int(s["decode_seqs"])
        if d > 0 and int(s["prefill_tokens"]) == 0:
            slot(band_of(d))["off"].append(float(s["step_s"]))
    out = []
    for band in sorted(bands, key=lambda b: int(b.split("-")[0])):
        b = bands[band]
        fwd, off = _median_ms(b["fwd"]), _median_ms(b["off"])
        out.append(
            {
                "band": band,
                "served_steps": len(b["fwd"]),
                "mean_decoders": statistics.fmean(b["d"]) if b["d"] else None,
                "served_forward_ms": fwd,
                "served_round_ms": _median_ms(b["round"]),
                "offline_steps": len(b["off"]),
                "offline_forward_ms": off,
                "served_over_offline_forward": fwd / off if fwd and off else None,
            }
        )
    return out
