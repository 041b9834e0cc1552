"""Training the length heads on fixed feature rows (the classifier and the regression baseline).

What one epoch does is here; how epochs run (seeded shuffles and dropout,
a checkpoint after every epoch, resumption, the best-validation-loss epoch
kept) is :func:`duetime.predict.epoch_loop.run_epochs`.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import numpy as np

from duetime.predict.epoch_loop import RunControl, TrainedEpochs, Trainee, run_rlp_epochs
from duetime.predict.length_model import HeadWeights, RLPConfig, soft_labels

Task = Literal["classify", "regress"]


def _mlp(d_in: int, d_out: int, hidden: int, dropout: float) -> Any:
    from torch import nn

    if hidden == 0:
        return nn.Sequential(nn.Linear(d_in, d_out))
    return nn.Sequential(
        nn.Linear(d_in, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, d_out)
    )


def _to_weights(model: Any, feat_mean: float, feat_std: float) -> HeadWeights:
    """The torch module as float16-rounded numpy arrays (what gets shipped and calibrated)."""
    linears = [m for m in model if hasattr(m, "weight")]
    arr = [
        (
            m.weight.detach().numpy().T.astype(np.float16).astype(np.float32),
            m.bias.detach().numpy().astype(np.float16).astype(np.float32),
        )
        for m in linears
    ]
    if len(arr) == 1:
        return HeadWeights(arr[0][0], arr[0][1], feat_mean=feat_mean, feat_std=feat_std)
    return HeadWeights(arr[0][0], arr[0][1], arr[1][0], arr[1][1], feat_mean, feat_std)


def fit_head(
    cfg: RLPConfig,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    *,
    task: Task = "classify",
    checkpoint: Path | None = None,
    resume: bool = False,
    data_id: str = "",
    progress: bool = True,
    stop_after: int | None = None,
    threads: int | None = 1,
) -> tuple[Any, TrainedEpochs]:
    """Train a head on feature rows ``x`` (embedding + standardised log prompt length).

    ``classify``: ``y`` are 0-based bucket classes, cross-entropy (with
    ``cfg.label_sigma`` smoothing). ``regress``: ``y`` are standardised
    targets, mean squared error. Returns the best-validation-loss torch module
    (in eval mode) and the epochs' record. ``checkpoint``, ``resume`` (same
    settings and data: ``data_id``) and ``stop_after``: see
    :func:`~duetime.predict.epoch_loop.run_epochs`. ``threads`` caps torch's
    threads: the batches are small, and one thread is faster than two on a
    shared 2-core machine.
    """
    import torch

    d_out = cfg.n_classes if task == "classify" else 1
    torch.manual_seed(cfg.training_seed)
    model = _mlp(x_train.shape[1], d_out, cfg.hidden, cfg.dropout)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=max(cfg.epochs, 1))
    xt = torch.from_numpy(np.ascontiguousarray(x_train, dtype=np.float32))
    xv = torch.from_numpy(np.ascontiguousarray(x_val, dtype=np.float32))
    if task == "classify":
        yt = torch.from_numpy(soft_labels(y_train, d_out, cfg.label_sigma))
        yv = torch.from_numpy(np.asarray(y_val, dtype=np.int64))
    else:
        yt = torch.from_numpy(np.asarray(y_train, dtype=np.float32)[:, None])
        yv = torch.from_numpy(np.asarray(y_val, dtype=np.float32)[:, None])

    def loss_fn(out: Any, target: Any, train: bool) -> Any:
        if task == "regress":
            return torch.nn.functional.mse_loss(out, target)
        if train:
            return -(target * torch.log_softmax(out, dim=1)).sum(dim=1).mean()
        return torch.nn.functional.cross_entropy(out, target)

    def train_epoch(gen: Any) -> float:
        model.train()
        total = 0.0
        perm = torch.randperm(len(xt), generator=gen)
        for lo in range(0, len(xt), cfg.batch_size):
            idx = perm[lo : lo + cfg.batch_size]
            loss = loss_fn(model(xt[idx]), yt[idx], True)
            opt.zero_grad()
            loss.backward()
            opt.step()
            total += loss.item() * len(idx)
        sched.step()
        return total / len(xt)

    def validate() -> float:
        model.eval()
        with torch.no_grad():
            return float(loss_fn(model(xv), yv, False))

    trainee = Trainee(
        opt,
        sched,
        train_epoch,
        validate,
        weights=lambda: {k: v.clone() for k, v in model.state_dict().items()},
        load_weights=model.load_state_dict,
    )
    identity = {
        "task": task,
        "config": asdict(cfg),
        "data_id": data_id,
        "shape": list(x_train.shape),
    }
    run = RunControl(checkpoint, resume, progress, stop_after, threads)
    epochs = run_rlp_epochs(
        trainee, cfg, run, score="val_loss", identity=identity, desc=f"training {task} head"
    )
    model.eval()
    return model, epochs


def head_weights(model: Any, feat_mean: float, feat_std: float) -> HeadWeights:
    """Public wrapper: the trained module as the numpy weights inference uses."""
    return _to_weights(model, feat_mean, feat_std)
