"""The shared epoch loop: best epoch kept, checkpoint resumed, foreign checkpoints refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from duetime.predict.epoch_loop import CheckpointError, Trainee, run_epochs


def scripted(scores: list[float]) -> tuple[Trainee, dict[str, Any]]:
    """A one-parameter model whose weight is the number of epochs run and whose
    validation score follows ``scores``."""
    w = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
    seen: dict[str, Any] = {"draws": []}

    def train_epoch(gen: Any) -> float:
        seen["draws"].append(int(torch.randint(0, 10**6, (1,), generator=gen)))
        with torch.no_grad():
            w.add_(1)
        return float(w.detach())

    def validate() -> float:
        return scores[int(w.item()) - 1]

    def load(state: dict[str, Any]) -> None:
        with torch.no_grad():
            w.copy_(state["w"])

    return Trainee(opt, sched, train_epoch, validate, lambda: {"w": w.detach().clone()}, load), {
        "w": w,
        **seen,
    }


def test_best_epoch_weights_are_returned_not_the_last() -> None:
    trainee, state = scripted([3.0, 1.0, 2.0, 1.5])
    done = run_epochs(trainee, epochs=4, seed=0, score="val", identity={}, progress=False)
    assert done.best_epoch == 2
    assert [h["val"] for h in done.history] == [3.0, 1.0, 2.0, 1.5]
    assert state["w"].item() == 2.0  # epoch 2's weights put back


def test_resumed_run_draws_what_an_uninterrupted_one_draws(tmp_path: Path) -> None:
    scores = [5.0, 4.0, 3.0, 2.0]
    ckpt = tmp_path / "c.ckpt"

    def run(trainee: Trainee, identity: int = 1, **kw: Any) -> Any:
        return run_epochs(
            trainee, epochs=4, seed=3, score="val", identity={"x": identity}, progress=False, **kw
        )

    whole, whole_state = scripted(scores)
    run(whole)
    first, first_state = scripted(scores)
    run(first, checkpoint=ckpt, stop_after=2)
    second, second_state = scripted(scores)
    done = run(second, checkpoint=ckpt, resume=True)
    assert first_state["draws"] + second_state["draws"] == whole_state["draws"]
    assert len(second_state["draws"]) == 2
    assert done.best_epoch == 4
    assert second_state["w"].item() == whole_state["w"].item() == 4.0
    with pytest.raises(CheckpointError, match="differs in x"):
        run(scripted(scores)[0], identity=2, checkpoint=ckpt, resume=True)
