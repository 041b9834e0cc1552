"""`duetime bench predict-length`: the response-length predictor against its baselines.

Scores a trained RLP file on the test split it was trained beside (same
encoder, same seeded split by conversation), fits the three baselines of
:mod:`duetime.predict.length_baselines` on the same train/val/calib rows,
and times single-prompt inference from text (word-piece tokenisation,
encoder, head, interval) on this CPU.

Targets: MAE <= 0.8 x the best baseline's; 90 % intervals cover
>= 88 % of held-out answers; inference <= 20 ms per prompt.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

TARGET_MAE_RATIO = 0.8
TARGET_COVERAGE_90 = 0.88
TARGET_INFER_MS = 20.0
NOMINAL_GRID = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)


def time_inference(model_path: Path, texts: list[str], prompt_lens: np.ndarray) -> np.ndarray:
    """Milliseconds per prompt, one prompt at a time, encoder always run (no cache, no memo)."""
    from duetime.predict.length_predictor import LearnedLengthPredictor

    pred = LearnedLengthPredictor(model_path, use_cache=False)
    pred.predict_texts(texts[:3], prompt_lens[:3], 4096)  # load and warm up
    out = np.empty(len(texts))
    for i, (text, plen) in enumerate(zip(texts, prompt_lens, strict=True)):
        pred._memo.clear()
        t0 = time.perf_counter()
        pred.predict_texts([text], [int(plen)], 4096)
        out[i] = (time.perf_counter() - t0) * 1e3
    return out


def score_model(
    model_path: Path, *, coverage: float = 0.9, infer_prompts: int = 200, progress: bool = True
) -> dict[str, Any]:
    """Every figure of one model file, with the baselines fitted on its features and split."""
    from duetime.predict.length_baselines import fit_baselines
    from duetime.predict.length_features import sharegpt_prompts
    from duetime.predict.length_fit import evaluate_rlp, load_length_data
    from duetime.predict.length_metrics import mae_ratio_interval
    from duetime.predict.length_model import LengthModel
    from duetime.predict.precision import weights_identity
    from duetime.workloads import load_sharegpt_lengths

    rlp = LengthModel.load(model_path)
    cfg = rlp.config
    encoder = rlp.encoder()  # bf16 models run in fp32 where bf16 is not native: scored so
    data = load_length_data(encoder, max_len=cfg.max_len, seed=cfg.seed, progress=progress)
    if weights_identity(data.encoder) != weights_identity(str(rlp.meta.get("encoder"))):
        raise ValueError(
            f"{model_path}: trained on encoder {rlp.meta.get('encoder')!r}, "
            f"but the cache gives {data.encoder!r}"
        )
    emb, plen, y = data.part("test")
    readouts = evaluate_rlp(rlp, data, "test", coverage=coverage)
    main = readouts[cfg.readout]

    t0 = time.perf_counter()
    baselines = fit_baselines(data, cfg)
    baseline_fit_s = time.perf_counter() - t0
    base_rows: dict[str, dict[str, Any]] = {}
    base_points: dict[str, np.ndarray] = {}
    for b in baselines:
        base_rows[b.name], base_points[b.name] = _baseline_row(b, emb, plen, y, coverage, cfg)
    if rlp.adapters:  # fine-tuned: also the head on the frozen features it started from
        name, row, point = frozen_reference(cfg, data, coverage, progress=progress)
        base_rows[name], base_points[name] = row, point
    best_name = min(base_rows, key=lambda k: base_rows[k]["mae_tokens"])

    pred = rlp.predict(emb, plen, cfg.max_len, coverage=coverage)
    for name, row in base_rows.items():  # the RLP's MAE over each baseline's, with its spread
        row["rlp_mae_ratio"] = main["mae_tokens"] / row["mae_tokens"]
        row["rlp_mae_ratio_ci95"] = list(mae_ratio_interval(pred.point - y, base_points[name] - y))
    grid = _grid(y, lambda c: _rlp_interval(rlp, emb, plen, c))

    rng = np.random.default_rng(0)
    pick = rng.choice(len(y), size=min(infer_prompts, len(y)), replace=False)
    rows = data.splits["test"][pick]
    lengths = load_sharegpt_lengths(progress=False)
    times = time_inference(model_path, sharegpt_prompts(lengths, rows), plen[pick])

    return {
        "model": str(model_path),
        "encoder": cfg.encoder,
        "infer_precision": encoder.precision,
        "readout": cfg.readout,
        "bucket_size_tokens": cfg.bucket_size,
        "max_len_tokens": cfg.max_len,
        "coverage_nominal": coverage,
        "test_rows": len(y),
        "split_sizes": {k: len(v) for k, v in data.splits.items()},
        "mae_tokens": main["mae_tokens"],
        "rmse_tokens": main["rmse_tokens"],
        "r2": main["r2"],
        "bucket_acc": main["bucket_acc"],
        "coverage": main["coverage"],  # at coverage_nominal, as the interval widths
        "coverage_90": grid["0.9"],  # the target, whatever --coverage asked
        "interval_width_tokens": main["interval_width_tokens"],
        "interval_width_median_tokens": main["interval_width_median_tokens"],
        "infer_p50_ms": float(np.percentile(times, 50)),
        "infer_p99_ms": float(np.percentile(times, 99)),
        "infer_mean_ms": float(times.mean()),
        "infer_prompts": len(times),
        "best_baseline": best_name,
        "mae_ratio_vs_best_baseline": main["mae_tokens"] / base_rows[best_name]["mae_tokens"],
        # how far the ratio moves with the test rows (paired bootstrap, 2,000 resamples)
        "mae_ratio_ci95": base_rows[best_name]["rlp_mae_ratio_ci95"],
        "readouts": readouts,
        "coverage_grid": grid,
        "baselines": base_rows,
        "baseline_fit_s": baseline_fit_s,
        "_plot": {"y": y, "point": pred.point, "lo": pred.lo, "hi": pred.hi, "base": base_points},
    }


FROZEN_REFERENCE = "minilm-static:512"


def frozen_reference(
    cfg: Any, data: Any, coverage: float, *, progress: bool
) -> tuple[str, dict[str, Any], np.ndarray]:
    """The regression head on frozen ``minilm-static:512`` features, same split and test rows:
    what a fine-tuned encoder has to beat to be worth its milliseconds."""
    from duetime.predict.length_baselines import regression_head
    from duetime.predict.length_fit import load_length_data
    from duetime.predict.length_model import RLPConfig

    frozen = load_length_data(
        FROZEN_REFERENCE, max_len=cfg.max_len, seed=cfg.seed, progress=progress
    )
    if not np.array_equal(frozen.splits["test"], data.splits["test"]):
        raise ValueError("the frozen reference's split differs from the model's")
    ref_cfg = RLPConfig(bucket_size=cfg.bucket_size, max_len=cfg.max_len, seed=cfg.seed)
    row, point = _baseline_row(
        regression_head(frozen, ref_cfg), *frozen.part("test"), coverage, cfg
    )
    return f"regression-head (frozen {FROZEN_REFERENCE})", row, point


def _baseline_row(
    b: Any, emb: np.ndarray, plen: np.ndarray, y: np.ndarray, coverage: float, cfg: Any
) -> tuple[dict[str, Any], np.ndarray]:
    """A fitted baseline's figures on the test rows (with its coverage grid) and its points."""
    from duetime.predict.length_metrics import length_metrics

    point = np.maximum(b.predict(emb, plen), 1.0)
    lo, hi = b.interval(point, coverage)
    row: dict[str, Any] = dict(length_metrics(y, point, lo, hi, bucket_size=cfg.bucket_size))
    row["coverage_grid"] = _grid(y, lambda c: b.interval(point, c))
    return row, point


def _rlp_interval(rlp: Any, emb: np.ndarray, plen: np.ndarray, c: float) -> tuple[Any, Any]:
    p = rlp.predict(emb, plen, rlp.config.max_len, coverage=c)
    return p.lo, p.hi


def _grid(y: np.ndarray, interval: Any) -> dict[str, float]:
    """Empirical coverage at each nominal level of :data:`NOMINAL_GRID`."""
    out = {}
    for c in NOMINAL_GRID:
        lo, hi = interval(c)
        out[f"{c:g}"] = float(np.mean((y >= lo) & (y <= hi)))
    return out


def targets(fig: dict[str, Any]) -> dict[str, bool]:
    return {
        "mae_ratio": fig["mae_ratio_vs_best_baseline"] <= TARGET_MAE_RATIO,
        "coverage_90": fig["coverage_90"] >= TARGET_COVERAGE_90,
        "infer_p99_ms": fig["infer_p99_ms"] <= TARGET_INFER_MS,
    }


def run(
    models: list[Path], *, coverage: float = 0.9, infer_prompts: int = 200, progress: bool = True
) -> dict[str, Any]:
    """Score each model; the first is the headline (its figures sit at the top level)."""
    scored = [
        score_model(m, coverage=coverage, infer_prompts=infer_prompts, progress=progress)
        for m in models
    ]
    head = dict(scored[0])
    head["targets"] = {
        "mae_ratio_vs_best_baseline_max": TARGET_MAE_RATIO,
        "coverage_90_min": TARGET_COVERAGE_90,
        "infer_ms_max": TARGET_INFER_MS,
    }
    head["targets_met"] = targets(scored[0])
    head["other_models"] = [
        {k: v for k, v in s.items() if k != "_plot"} | {"targets_met": targets(s)}
        for s in scored[1:]
    ]
    head["_all_plots"] = [(Path(s["model"]).stem, s["_plot"], s["coverage_grid"]) for s in scored]
    return head


def plot(fig: dict[str, Any], path: Path) -> Path:
    """Predicted vs true (log-log, with intervals) per model, and coverage vs nominal."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = fig["_all_plots"]
    f, axes = plt.subplots(1, len(panels) + 1, figsize=(5.5 * (len(panels) + 1), 5))
    rng = np.random.default_rng(0)
    for ax, (name, d, _) in zip(axes, panels, strict=False):
        y, p, lo, hi = d["y"], d["point"], d["lo"], d["hi"]
        idx = rng.choice(len(y), size=min(300, len(y)), replace=False)
        inside = (y[idx] >= lo[idx]) & (y[idx] <= hi[idx])
        for ok, colour in ((True, "tab:blue"), (False, "tab:red")):
            sel = idx[inside == ok]
            ax.errorbar(
                y[sel],
                p[sel],
                yerr=[p[sel] - lo[sel], hi[sel] - p[sel]],
                fmt="o",
                ms=2,
                alpha=0.35,
                color=colour,
                elinewidth=0.5,
                label=f"{'inside' if ok else 'outside'} 90% interval",
            )
        top = max(float(y.max()), float(hi.max()))
        ax.plot([1, top], [1, top], "k--", lw=0.8, label="predicted = true")
        ax.set(
            xscale="log",
            yscale="log",
            xlabel="true answer length (tokens)",
            ylabel="predicted (tokens)",
            title=f"{name}: predicted vs true (test)",
        )
        ax.legend(fontsize=7, loc="upper left")
    ax = axes[-1]
    grid = [float(c) for c in panels[0][2]]
    ax.plot(grid, grid, "k--", lw=0.8, label="nominal")
    for name, _, cov in panels:
        ax.plot(grid, list(cov.values()), "o-", label=f"RLP {name}")
    for bname, row in fig["baselines"].items():
        ax.plot(grid, list(row["coverage_grid"].values()), ".:", label=bname)
    ax.axhline(TARGET_COVERAGE_90, color="grey", lw=0.5)
    ax.set(
        xlabel="nominal coverage",
        ylabel="empirical coverage (test)",
        title="conformal interval coverage",
    )
    ax.legend(fontsize=7)
    f.tight_layout()
    from duetime.metrics.atomic import save_png

    return save_png(f, path)
