"""The one epoch loop behind every RLP trainer: seeded, checkpointed, resumable, best epoch kept.

The bucket head on frozen features (:mod:`~duetime.predict.length_train`) and
the fine-tuned encoder (:mod:`~duetime.predict.length_finetune`) differ in
what one epoch does, not in how epochs are run. Both need the same
guarantees, so they live here once:

- each epoch's shuffle and dropout come from generators seeded by
  ``(seed, epoch)``, so a run resumed from a checkpoint ends with the same
  weights as an uninterrupted one (on a CPU; GPU kernels are not
  bit-reproducible);
- a checkpoint (weights, optimiser, scheduler, history, best epoch) is
  rewritten atomically after every epoch, and one made with other settings or
  data is refused, naming what changed;
- the epoch with the lowest validation score is the one returned.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

from duetime.workloads._files import atomic_writer

if TYPE_CHECKING:
    from duetime.predict.length_model import RLPConfig

# Bump when the checkpoint's layout changes: an older checkpoint is then refused, not misread.
# 2: one layout for the head and the fine-tuned encoder ("weights", "best_score").
CHECKPOINT_VERSION = 2


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed here (other settings, data or layout)."""


def epoch_seed(seed: int, epoch: int) -> int:
    """The seed of one epoch's shuffle (and, plus one, of its dropout masks)."""
    return (seed * 1_000_003 + epoch * 7_919) % (2**63 - 1)


@dataclass(slots=True)
class Trainee:
    """What the loop drives. Every callable acts on one model being trained.

    ``train_epoch(generator)`` makes one pass over the training rows in the
    order the torch ``generator`` draws and returns the mean training loss
    (it steps the scheduler as its schedule wants); ``validate()`` returns the
    validation score, lower is better; ``weights()`` returns detached copies of
    what is trained and ``load_weights`` puts such a copy back.
    """

    optimizer: Any
    scheduler: Any
    train_epoch: Callable[[Any], float]
    validate: Callable[[], float]
    weights: Callable[[], dict[str, Any]]
    load_weights: Callable[[dict[str, Any]], None]


@dataclass(slots=True)
class TrainedEpochs:
    """Per-epoch history (``epoch``, ``train_loss``, the score) and the epoch kept (1-based)."""

    history: list[dict[str, float]]
    best_epoch: int  # 0 when no epoch ran


@dataclass(frozen=True, slots=True)
class RunControl:
    """How a trainer's epochs run, whatever it trains: ``checkpoint``, ``resume``,
    ``progress`` and ``stop_after`` as :func:`run_epochs` takes them; ``threads`` caps
    torch's CPU threads meanwhile (``None``: leave them)."""

    checkpoint: Path | None = None
    resume: bool = False
    progress: bool = True
    stop_after: int | None = None
    threads: int | None = None


def run_rlp_epochs(
    trainee: Trainee,
    cfg: RLPConfig,
    run: RunControl,
    *,
    score: str,
    identity: dict[str, Any],
    desc: str,
) -> TrainedEpochs:
    """:func:`run_epochs` for an RLP trainer: ``cfg``'s epochs and training seed, under
    ``run``'s checkpointing and thread cap."""
    from duetime.predict.length_features import torch_threads

    with torch_threads(run.threads):
        return run_epochs(
            trainee,
            epochs=cfg.epochs,
            seed=cfg.training_seed,
            score=score,
            identity=identity,
            checkpoint=run.checkpoint,
            resume=run.resume,
            progress=run.progress,
            stop_after=run.stop_after,
            desc=desc,
        )


def run_epochs(
    trainee: Trainee,
    *,
    epochs: int,
    seed: int,
    score: str,
    identity: dict[str, Any],
    checkpoint: Path | None = None,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    desc: str = "training",
) -> TrainedEpochs:
    """Run epochs up to ``epochs``; leave the best-``score`` weights loaded in the trainee.

    ``identity`` names the settings and data; a checkpoint is resumed only if
    it was made with the same. ``stop_after`` ends early after that many
    epochs of this call (to test resumption).
    """
    import torch

    identity = {"version": CHECKPOINT_VERSION, **identity}
    start, history = 0, []
    best_score, best_weights = float("inf"), {}
    if resume and checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True, map_location="cpu")
        if state.get("identity") != identity:
            raise CheckpointError(
                f"{checkpoint}: checkpoint was made with other settings or data "
                f"({_diff(state.get('identity'), identity)}); delete it or drop --resume"
            )
        trainee.load_weights(state["weights"])
        trainee.optimizer.load_state_dict(state["optim"])
        trainee.scheduler.load_state_dict(state["sched"])
        start, history = int(state["epoch"]), list(state["history"])
        best_score, best_weights = float(state["best_score"]), state["best_weights"]

    bar = tqdm(
        range(start, epochs),
        initial=start,
        total=epochs,
        unit="epoch",
        desc=desc,
        disable=not progress,
        file=sys.stderr,
    )
    for epoch in bar:
        gen = torch.Generator().manual_seed(epoch_seed(seed, epoch))
        torch.manual_seed(epoch_seed(seed, epoch) + 1)  # dropout masks
        train_loss = trainee.train_epoch(gen)
        val = trainee.validate()
        history.append({"epoch": epoch + 1, "train_loss": train_loss, score: val})
        if val < best_score:
            best_score, best_weights = val, trainee.weights()
        bar.set_postfix(train=f"{train_loss:.4g}", **{score: f"{val:.4g}"})
        if checkpoint is not None:
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            with atomic_writer(checkpoint, binary=True) as f:
                torch.save(
                    {
                        "identity": identity,
                        "epoch": epoch + 1,
                        "weights": trainee.weights(),
                        "optim": trainee.optimizer.state_dict(),
                        "sched": trainee.scheduler.state_dict(),
                        "history": history,
                        "best_score": best_score,
                        "best_weights": best_weights,
                    },
                    f,
                )
        if stop_after is not None and epoch + 1 - start >= stop_after and epoch + 1 < epochs:
            break
    if best_weights:
        trainee.load_weights(best_weights)
    best_epoch = min(history, key=lambda h: h[score])["epoch"] if history else 0
    return TrainedEpochs(history, int(best_epoch))


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
