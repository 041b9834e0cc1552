"""Training loop for the length heads: seeded, checkpointed every epoch, resumable.

Every epoch is a pure function of (weights, optimiser state, seed, epoch):
the shuffle and the dropout masks are drawn from generators seeded with
``(seed, epoch)``. So a run stopped after epoch ``e`` and resumed from its
checkpoint ends with the same weights as a run that never stopped.

The weights kept are those of the epoch with the lowest validation loss
(the checkpoint carries them too).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tqdm import tqdm

from duetime.predict.length_model import HeadWeights, RLPConfig, soft_labels
from duetime.workloads._files import atomic_writer

CHECKPOINT_VERSION = 1
Task = Literal["classify", "regress"]


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed: other version, settings or data."""


def _mlp(d_in: int, d_out: int, hidden: int, dropout: float) -> Any:
    from torch import nn

    if hidden == 0:
        return nn.Sequential(nn.Linear(d_in, d_out))
    return nn.Sequential(
        nn.Linear(d_in, hidden), nn.GELU(), nn.Dropout(dropout), nn.Linear(hidden, d_out)
    )


def _epoch_seed(seed: int, epoch: int) -> int:
    return (seed * 1_000_003 + epoch * 7_919) % (2**63 - 1)


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
    on_epoch: Callable[[int, float, float], None] | None = None,
    threads: int | None = 1,
) -> tuple[Any, list[dict[str, float]]]:
    """Train a head on feature rows ``x`` (embedding + standardised log prompt length).

    ``classify``: ``y`` are 0-based bucket classes, cross-entropy (with
    ``cfg.label_sigma`` smoothing). ``regress``: ``y`` are standardised
    targets, mean squared error. Returns the best-validation torch module and
    the per-epoch history. ``checkpoint`` is rewritten atomically after every
    epoch; ``resume`` continues from it (it must come from the same settings
    and data: ``data_id``). ``stop_after`` ends early after that many epochs
    (to test resumption). ``threads`` caps torch's threads: the batches are small, and
    one thread is faster than two on a shared 2-core machine.
    """
    from duetime.predict.length_features import torch_threads

    with torch_threads(threads):
        return _fit(
            cfg,
            x_train,
            y_train,
            x_val,
            y_val,
            task=task,
            checkpoint=checkpoint,
            resume=resume,
            data_id=data_id,
            progress=progress,
            stop_after=stop_after,
            on_epoch=on_epoch,
        )


def _fit(
    cfg: RLPConfig,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_val: np.ndarray,
    y_val: np.ndarray,
    *,
    task: Task,
    checkpoint: Path | None,
    resume: bool,
    data_id: str,
    progress: bool,
    stop_after: int | None,
    on_epoch: Callable[[int, float, float], None] | None,
) -> tuple[Any, list[dict[str, float]]]:
    import torch

    d_out = cfg.n_classes if task == "classify" else 1
    torch.manual_seed(cfg.seed)
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

    identity = {
        "version": CHECKPOINT_VERSION,
        "task": task,
        "config": asdict(cfg),
        "data_id": data_id,
        "shape": list(x_train.shape),
    }
    start, history = 0, []
    best: tuple[float, dict[str, Any]] = (float("inf"), {})
    if resume and checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True)
        if state.get("identity") != identity:
            raise CheckpointError(
                f"{checkpoint}: checkpoint was made with other settings or data "
                f"({_diff(state.get('identity'), identity)}); delete it or drop --resume"
            )
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        start, history = int(state["epoch"]), list(state["history"])
        best = (float(state["best_loss"]), state["best_model"])

    def loss_fn(out: Any, target: Any, train: bool) -> Any:
        if task == "regress":
            return torch.nn.functional.mse_loss(out, target)
        if train:
            return -(target * torch.log_softmax(out, dim=1)).sum(dim=1).mean()
        return torch.nn.functional.cross_entropy(out, target)

    bar = tqdm(
        range(start, cfg.epochs),
        initial=start,
        total=cfg.epochs,
        unit="epoch",
        desc=f"training {task} head",
        disable=not progress,
        file=sys.stderr,
    )
    for epoch in bar:
        gen = torch.Generator().manual_seed(_epoch_seed(cfg.seed, epoch))
        torch.manual_seed(_epoch_seed(cfg.seed, epoch) + 1)  # dropout masks
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
        model.eval()
        with torch.no_grad():
            val = float(loss_fn(model(xv), yv, False))
        history.append({"epoch": epoch + 1, "train_loss": total / len(xt), "val_loss": val})
        if val < best[0]:
            best = (val, {k: v.clone() for k, v in model.state_dict().items()})
        bar.set_postfix(train=f"{total / len(xt):.4f}", val=f"{val:.4f}")
        if on_epoch is not None:
            on_epoch(epoch + 1, total / len(xt), val)
        if checkpoint is not None:
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            with atomic_writer(checkpoint, binary=True) as f:
                torch.save(
                    {
                        "identity": identity,
                        "epoch": epoch + 1,
                        "model": model.state_dict(),
                        "optim": opt.state_dict(),
                        "sched": sched.state_dict(),
                        "history": history,
                        "best_loss": best[0],
                        "best_model": best[1],
                    },
                    f,
                )
        if stop_after is not None and epoch + 1 - start >= stop_after and epoch + 1 < cfg.epochs:
            break
    if best[1]:
        model.load_state_dict(best[1])
    model.eval()
    return model, history


def _diff(old: Any, new: dict[str, Any]) -> str:
    if not isinstance(old, dict):
        return "unreadable identity"
    if old.get("version") != new["version"]:
        return f"checkpoint version {old.get('version')}, this duetime writes {new['version']}"
    keys = [k for k in new if old.get(k) != new[k]]
    if "config" in keys:
        cfg_old, cfg_new = old.get("config") or {}, new["config"]
        changed = [
            f"{k}: {cfg_old.get(k)!r} -> {v!r}" for k, v in cfg_new.items() if cfg_old.get(k) != v
        ]
        return "config " + ", ".join(changed)
    return "differs in " + ", ".join(keys)


def head_weights(model: Any, feat_mean: float, feat_std: float) -> HeadWeights:
    """Public wrapper: the trained module as the numpy weights inference uses."""
    return _to_weights(model, feat_mean, feat_std)
