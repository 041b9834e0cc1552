"""Timed engine steps as JSON lines: the executor's telemetry read back, and a profile's
steps written out (``duetime profile --samples``) in the same fields.

Why one format: a profile's samples saved this way load with the reader the executor's
telemetry uses, so a step-cost fit can be redone or compared offline
(``fit_batch_cost(steps_from_telemetry(path))``) without timing the engine again.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from duetime.metrics.atomic import atomic_path
from duetime.predict.ete import StepSample, step_kind

__all__ = ["steps_from_telemetry", "write_steps"]


def steps_from_telemetry(path: Path) -> list[StepSample]:
    """The executor's per-step telemetry lines (or :func:`write_steps`'s) as samples."""
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        out.append(
            StepSample(
                r["prefill_tokens"],
                float(r["prefill_attn"]),
                r["decode_seqs"],
                r["kv_tokens_attended"],
                r["step_s"],
                step_kind(r["prefill_tokens"], r["decode_seqs"]),
                tuple((int(rows), int(end)) for rows, end in r.get("prefill_chunks", ())),
            )
        )
    return out


def write_steps(path: Path, samples: Sequence[StepSample], sources: Sequence[str]) -> Path:
    """Write each sample as one telemetry-shaped JSON line, with where it was timed
    (``sources``, one a sample: ``grid`` or ``serving``); atomically, so a failed write
    leaves no half-written file."""
    if len(sources) != len(samples):
        raise ValueError(f"{len(sources)} sources for {len(samples)} samples")
    lines = [
        json.dumps(
            {
                "source": src,
                "kind": s.kind,
                "prefill_tokens": s.prefill_tokens,
                "prefill_attn": s.prefill_attn,
                "prefill_chunks": s.chunks,
                "decode_seqs": s.decode_seqs,
                "kv_tokens_attended": s.kv_tokens,
                "step_s": s.seconds,
            }
        )
        for s, src in zip(samples, sources, strict=True)
    ]
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("".join(line + "\n" for line in lines))
    return path
