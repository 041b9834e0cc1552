"""Baselines for the response-length predictor, each with a split-conformal interval.

- ``constant-mean``: the training mean, whatever the prompt.
- ``linear-prompt-len``: least squares ``N̂ = a + b·prompt_len``.
- ``regression-head``: the RLP's MLP on the same features (embedding + log
  prompt length), one output, mean squared error: TimeBill's "regression
  manner" variant of its own predictor.

Intervals use :class:`~duetime.predict.conformal.ResidualConformal`
(``|y − ŷ|``, the textbook split-conformal score) on the calibration split.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from duetime.predict.conformal import ResidualConformal
from duetime.predict.length_data import LengthData
from duetime.predict.length_model import RLPConfig, prompt_len_feature

Predict = Callable[[np.ndarray, np.ndarray], np.ndarray]  # (emb, prompt_len) -> point


@dataclass(slots=True, eq=False)
class Baseline:
    """A fitted point predictor and its calibrated residuals."""

    name: str
    predict: Predict
    conformal: ResidualConformal

    def interval(self, point: np.ndarray, coverage: float) -> tuple[np.ndarray, np.ndarray]:
        return self.conformal.interval(point, coverage)


def features(emb: np.ndarray, prompt_len: np.ndarray, mean: float, std: float) -> np.ndarray:
    """The RLP's input rows: embedding plus the standardised log prompt length."""
    z = (prompt_len_feature(prompt_len) - mean) / std
    return np.concatenate([emb, z[:, None]], axis=1).astype(np.float32)


def _calibrated(name: str, predict: Predict, data: LengthData) -> Baseline:
    emb, plen, y = data.part("calib")
    return Baseline(name, predict, ResidualConformal.fit(y, np.maximum(predict(emb, plen), 1.0)))


def constant_mean(data: LengthData) -> Baseline:
    mean = float(data.part("train")[2].mean())
    return _calibrated("constant-mean", lambda e, p: np.full(len(p), mean), data)


def linear_prompt_len(data: LengthData) -> Baseline:
    _, plen, y = data.part("train")
    b, a = np.polyfit(plen.astype(np.float64), y.astype(np.float64), 1)
    return _calibrated("linear-prompt-len", lambda e, p: a + b * p, data)


def regression_head(data: LengthData, cfg: RLPConfig, *, progress: bool = False) -> Baseline:
    """The same MLP as the classifier, regressing the standardised length with MSE."""
    import torch

    from duetime.predict.length_train import fit_head

    e_tr, p_tr, y_tr = data.part("train")
    e_va, p_va, y_va = data.part("val")
    z = prompt_len_feature(p_tr)
    fm, fs = float(z.mean()), float(z.std() or 1.0)
    ym, ys = float(y_tr.mean()), float(y_tr.std() or 1.0)
    model, _ = fit_head(
        replace(cfg, label_sigma=0.0),
        features(e_tr, p_tr, fm, fs),
        (y_tr - ym) / ys,
        features(e_va, p_va, fm, fs),
        (y_va - ym) / ys,
        task="regress",
        progress=progress,
    )

    def predict(emb: np.ndarray, plen: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            out = model(torch.from_numpy(features(emb, plen, fm, fs))).numpy()[:, 0]
        return out.astype(np.float64) * ys + ym

    return _calibrated("regression-head", predict, data)


def fit_baselines(data: LengthData, cfg: RLPConfig, *, progress: bool = False) -> list[Baseline]:
    """All three baselines, fitted on ``train`` (and ``val``), calibrated on ``calib``."""
    return [
        constant_mean(data),
        linear_prompt_len(data),
        regression_head(data, cfg, progress=progress),
    ]
