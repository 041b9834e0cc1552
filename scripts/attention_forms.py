"""Held-out step-cost error with a chunk's attention counted dense (``rows·end``) and
as the engine's kernels count it (its attention shape), on the same timed steps.

Reads the steps `duetime profile --samples STEPS` saved (each chunk's rows and end are
recorded) and the profile it wrote beside them (``STEPS`` without ``-steps.jsonl``, plus
``.json``: its regimes), refits both ways on the same random 75/25 splits and prints the
mean held-out MAPE of lone prompts, mixed steps and decodes; then TimeBill's own
prefill form (``aN² + bN + c``) fitted and judged on every lone prompt step against
whole prompts alone, its domain. Reproduces docs/results.md#attention-shape::

    duetime profile --dtype q8 --out out/p1.json --samples out/p1-steps.jsonl
    .venv/bin/python scripts/attention_forms.py out/p1-steps.jsonl [more ...]
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import numpy as np

from duetime.core.attention_shape import AttentionShape
from duetime.core.cost import chunk_attention
from duetime.core.cost_bands import CostRegimes
from duetime.engine.step_samples import steps_from_telemetry
from duetime.predict.ete import (
    StepSample,
    cost_mape_pct,
    fit_batch_cost,
    fit_timebill,
    split_samples,
    whole_prompts,
)


def recount(samples: list[StepSample], shape: AttentionShape | None) -> list[StepSample]:
    """The samples with ``prefill_attn`` counted from their chunks under ``shape``."""
    missing = [s for s in samples if s.prefill_tokens and not s.chunks]
    if missing:
        raise SystemExit(f"{len(missing)} prompt steps have no recorded chunks: profile again")
    return [
        replace(s, prefill_attn=sum(chunk_attention(r, e, shape) for r, e in s.chunks))
        for s in samples
    ]


def heldout(samples: list[StepSample], regimes: CostRegimes, splits: int) -> dict[str, float]:
    """Mean held-out MAPE (%) by step kind over ``splits`` random 75/25 splits."""
    by_kind: dict[str, list[float]] = {"prefill": [], "mixed": [], "decode": []}
    for seed in range(splits):
        train, test = split_samples(samples, 0.25, seed)
        cost = fit_batch_cost(train, regimes=regimes)
        for kind, errs in by_kind.items():
            errs.append(cost_mape_pct(cost, [s for s in test if s.kind == kind]))
    return {kind: float(np.mean(v)) for kind, v in by_kind.items()}


def timebill_prefill(samples: list[StepSample], whole: bool, splits: int) -> float:
    """Held-out MAPE (%) of TimeBill's prefill form on lone prompt steps (``whole``: on
    whole prompts alone, as ``fit_timebill`` now fits and ``evaluate`` judges it)."""
    pre = whole_prompts(samples) if whole else [s for s in samples if s.kind == "prefill"]
    decodes = [s for s in samples if s.kind == "decode" and s.decode_seqs == 1]
    errs = []
    for seed in range(splits):
        train, test = split_samples(pre, 0.25, seed)
        # without recorded chunks fit_timebill takes every lone prompt step as whole
        ete = fit_timebill([replace(s, chunks=()) for s in train] + decodes)
        errs.append(100 * float(np.mean([abs(ete.prefill(s.prefill_tokens) / s.seconds - 1)
                                         for s in test])))  # fmt: skip
    return float(np.mean(errs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("steps", nargs="+", type=Path, help="`duetime profile --samples` files")
    ap.add_argument("--splits", type=int, default=8)
    args = ap.parse_args()
    rows = {}
    for path in args.steps:
        profile = json.loads(path.with_name(path.name.replace("-steps.jsonl", ".json")).read_text())
        edges = {axis: tuple(v) for axis, v in profile["regimes"].items()}
        engine_shape = AttentionShape.from_dict(profile["attention"])  # what the engine ran
        samples = steps_from_telemetry(path)
        rows[str(path)] = {
            form: heldout(recount(samples, shape), CostRegimes(**edges, attention=shape),
                          args.splits)
            for form, shape in (("dense", None), ("shape", engine_shape))
        }  # fmt: skip
        for form, e in rows[str(path)].items():
            print(f"{path} {form:5s}: prompts {e['prefill']:.2f} %, mixed {e['mixed']:.2f} %, "
                  f"decodes {e['decode']:.2f} %")  # fmt: skip
        tb = {kind: timebill_prefill(samples, kind == "whole", args.splits)
              for kind in ("every", "whole")}  # fmt: skip
        rows[str(path)]["timebill_prefill"] = tb
        print(f"{path} TimeBill's prefill form: every lone prompt step {tb['every']:.2f} %, "
              f"whole prompts {tb['whole']:.2f} %")  # fmt: skip
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
