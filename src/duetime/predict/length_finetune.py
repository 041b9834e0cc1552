"""Fine-tuning the RLP (``minilm-ft``): LoRA adapters on MiniLM, trained with the bucket head.

The loss is TimeBill's: cross-entropy over length buckets, here through the
encoder as well as the head. LoRA (``peft``) keeps the trainable part small,
so a model file carries ~1.6 MB of adapters instead of a 90 MB encoder.
Training takes minutes on a GPU (``--device cuda``) and hours on a 2-core
CPU. The epoch kept is the one with the lowest validation MAE of the model's
readout (the cross-entropy of 256 classes tracks MAE loosely here).

As in :mod:`~duetime.predict.length_train`, each epoch's shuffle and dropout
come from generators seeded by ``(seed, epoch)``, a checkpoint is written
after every epoch, and a resumed run refuses a checkpoint made with other
settings or data. On a CPU a resumed run ends with the same weights as an
uninterrupted one; GPU kernels are not bit-reproducible.
"""

from __future__ import annotations

import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from duetime.predict.conformal import BucketCDF
from duetime.predict.length_ft_encoder import (
    FT_DIM,
    LORA_TARGETS,
    FinetunedMiniLMEncoder,
    load_base,
    parse_ft_spec,
    pooled_features,
)
from duetime.predict.length_model import HeadWeights, LengthModel, RLPConfig, bucket_of
from duetime.predict.length_model import readout_point as _readout
from duetime.predict.length_tokens import TokenBundle
from duetime.predict.length_train import (
    CheckpointError,
    _diff,
    _epoch_seed,
    _mlp,
    head_weights,
)
from duetime.workloads._files import atomic_writer

CHECKPOINT_VERSION = 1
WARMUP_FRACTION = 0.05
_PEFT_PREFIX = "base_model.model."


def _build(cfg: RLPConfig, device: str) -> Any:
    from peft import LoraConfig, get_peft_model
    from torch import nn

    _, layers = parse_ft_spec(cfg.encoder)
    lora = LoraConfig(
        r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, target_modules=list(LORA_TARGETS)
    )
    bert = get_peft_model(load_base(layers), lora)
    head = _mlp(FT_DIM + 1, cfg.n_classes, cfg.hidden, cfg.dropout)
    return nn.ModuleDict({"bert": bert, "head": head}).to(device)


def _logits(net: Any, seqs: list[np.ndarray], z: np.ndarray, max_tokens: int, device: str) -> Any:
    import torch

    feats = pooled_features(net["bert"], seqs, max_tokens, device)
    zt = torch.as_tensor(z, dtype=torch.float32, device=device)[:, None]
    return net["head"](torch.cat([feats, zt], dim=1)).float()


def export_adapters(net: Any) -> dict[str, np.ndarray]:
    """``<module>.lora_A`` (r × in) and ``<module>.lora_B`` (out × r, scaling folded in),
    rounded to float16: what the model file keeps and inference merges."""
    out = {}
    for name, module in net["bert"].named_modules():
        if not hasattr(module, "lora_A") or "default" not in module.lora_A:
            continue
        plain = name.removeprefix(_PEFT_PREFIX)
        a = module.lora_A["default"].weight.detach().float().cpu().numpy()
        b = module.lora_B["default"].weight.detach().float().cpu().numpy()
        b = b * float(module.scaling["default"])
        out[f"{plain}.lora_A"] = a.astype(np.float16).astype(np.float32)
        out[f"{plain}.lora_B"] = b.astype(np.float16).astype(np.float32)
    return out


def fit_finetuned(
    cfg: RLPConfig,
    bundle: TokenBundle,
    *,
    device: str = "cpu",
    checkpoint: Path | None = None,
    resume: bool = False,
    progress: bool = True,
    stop_after: int | None = None,
    threads: int | None = None,
) -> tuple[dict[str, np.ndarray], HeadWeights, list[dict[str, float]]]:
    """Train adapters and head on ``train``; keep the best ``val`` epoch.

    Returns (adapters, head weights, per-epoch history). ``threads`` caps
    torch's CPU threads (``None``: leave them).
    """
    from duetime.predict.length_features import torch_threads

    with torch_threads(threads):
        return _fit(cfg, bundle, device, checkpoint, resume, progress, stop_after)


def _fit(
    cfg: RLPConfig,
    bundle: TokenBundle,
    device: str,
    checkpoint: Path | None,
    resume: bool,
    progress: bool,
    stop_after: int | None,
) -> tuple[dict[str, np.ndarray], HeadWeights, list[dict[str, float]]]:
    import torch

    max_tokens, _ = parse_ft_spec(cfg.encoder)
    tr, va = bundle.splits["train"], bundle.splits["val"]
    seqs_tr, seqs_va = bundle.seqs(tr), bundle.seqs(va)
    logp = np.log(np.maximum(bundle.prompt_len, 1).astype(np.float64))
    fm, fs = float(logp[tr].mean()), float(logp[tr].std() or 1.0)
    z = (logp - fm) / fs
    classes = np.minimum(bucket_of(bundle.output_len, cfg.bucket_size), cfg.n_classes) - 1
    y_va = bundle.output_len[va].astype(np.float64)

    torch.manual_seed(cfg.seed)
    net = _build(cfg, device)
    trainable = [(n, p) for n, p in net.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        [
            {
                "params": [p for n, p in trainable if not n.startswith("head.")],
                "lr": cfg.encoder_lr,
            },
            {"params": [p for n, p in trainable if n.startswith("head.")], "lr": cfg.lr},
        ],
        weight_decay=cfg.weight_decay,
    )
    steps_per_epoch = math.ceil(len(tr) / cfg.batch_size)
    total = max(1, cfg.epochs * steps_per_epoch)
    warm = max(1, int(WARMUP_FRACTION * total))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / total))),
    )
    identity = {
        "version": CHECKPOINT_VERSION,
        "config": asdict(cfg),
        "data": bundle.dataset,
        "split": {k: [len(v), int(v.sum()) if len(v) else 0] for k, v in bundle.splits.items()},
    }

    def trainable_state() -> dict[str, Any]:
        return {n: p.detach().cpu().clone() for n, p in trainable}

    start, history = 0, []
    best: tuple[float, dict[str, Any]] = (float("inf"), {})
    if resume and checkpoint is not None and checkpoint.exists():
        state = torch.load(checkpoint, weights_only=True, map_location="cpu")
        if state.get("identity") != identity:
            raise CheckpointError(
                f"{checkpoint}: checkpoint was made with other settings or data "
                f"({_diff(state.get('identity'), identity)}); delete it or drop --resume"
            )
        _load_trainable(net, state["model"])
        opt.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        start, history = int(state["epoch"]), list(state["history"])
        best = (float(state["best_mae"]), state["best_model"])

    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.startswith("cuda"))
    bar = tqdm(
        range(start, cfg.epochs),
        initial=start,
        total=cfg.epochs,
        unit="epoch",
        desc=f"fine-tuning {cfg.encoder} (LoRA r={cfg.lora_rank}) on {device}",
        disable=not progress,
        file=sys.stderr,
    )
    for epoch in bar:
        gen = torch.Generator().manual_seed(_epoch_seed(cfg.seed, epoch))
        torch.manual_seed(_epoch_seed(cfg.seed, epoch) + 1)  # dropout masks
        net.train()
        loss_sum = 0.0
        perm = torch.randperm(len(tr), generator=gen).numpy()
        for lo in range(0, len(perm), cfg.batch_size):
            idx = perm[lo : lo + cfg.batch_size]
            with autocast:
                out = _logits(net, [seqs_tr[i] for i in idx], z[tr[idx]], max_tokens, device)
            target = torch.as_tensor(classes[tr[idx]], device=device)
            loss = torch.nn.functional.cross_entropy(out, target)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            loss_sum += loss.item() * len(idx)
        val_mae = _val_mae(net, cfg, seqs_va, z[va], y_va, max_tokens, device, autocast)
        history.append(
            {"epoch": epoch + 1, "train_loss": loss_sum / len(tr), "val_mae_tokens": val_mae}
        )
        if val_mae < best[0]:
            best = (val_mae, trainable_state())
        bar.set_postfix(train=f"{loss_sum / len(tr):.3f}", val_mae=f"{val_mae:.1f}")
        if checkpoint is not None:
            checkpoint.parent.mkdir(parents=True, exist_ok=True)
            with atomic_writer(checkpoint, binary=True) as f:
                torch.save(
                    {
                        "identity": identity,
                        "epoch": epoch + 1,
                        "model": trainable_state(),
                        "optim": opt.state_dict(),
                        "sched": sched.state_dict(),
                        "history": history,
                        "best_mae": best[0],
                        "best_model": best[1],
                    },
                    f,
                )
        if stop_after is not None and epoch + 1 - start >= stop_after and epoch + 1 < cfg.epochs:
            break
    if best[1]:
        _load_trainable(net, best[1])
    net.eval()
    return export_adapters(net), head_weights(net["head"].cpu(), fm, fs), history


def _load_trainable(net: Any, state: dict[str, Any]) -> None:
    # strict=False: the frozen base weights are missing from ``state`` by design
    _, unexpected = net.load_state_dict(state, strict=False)
    wanted = {n for n, p in net.named_parameters() if p.requires_grad}
    if unexpected or wanted - set(state):
        raise CheckpointError("checkpoint does not hold this model's trainable weights")


def _val_mae(
    net: Any,
    cfg: RLPConfig,
    seqs: list[np.ndarray],
    z: np.ndarray,
    y: np.ndarray,
    max_tokens: int,
    device: str,
    autocast: Any,
) -> float:
    import torch

    net.eval()
    probs = []
    with torch.no_grad(), autocast:
        for lo in range(0, len(seqs), 128):
            out = _logits(net, seqs[lo : lo + 128], z[lo : lo + 128], max_tokens, device)
            probs.append(torch.softmax(out, dim=1).double().cpu().numpy())
    point = _readout(BucketCDF(np.concatenate(probs), cfg.bucket_size), cfg.readout)
    point = np.maximum(np.minimum(point, cfg.max_len), 1.0)
    return float(np.abs(point - y).mean())


def train_finetuned_rlp(
    bundle: TokenBundle,
    cfg: RLPConfig,
    *,
    device: str = "cpu",
    checkpoint: Path | None = None,
    resume: bool = False,
    progress: bool = True,
    coverage: float = 0.9,
    stop_after: int | None = None,
    threads: int | None = None,
) -> LengthModel:
    """Fine-tune on ``device``, then calibrate and score with the CPU inference path.

    The conformal scores and test figures come from
    :class:`FinetunedMiniLMEncoder` (float32, adapters merged, as a predictor
    runs it), never from the training-time network, so the file predicts
    exactly what was calibrated.
    """
    from duetime.predict.length_data import LengthData
    from duetime.predict.length_fit import calibrated_model

    adapters, weights, history = fit_finetuned(
        cfg,
        bundle,
        device=device,
        checkpoint=checkpoint,
        resume=resume,
        progress=progress,
        stop_after=stop_after,
        threads=threads,
    )
    max_tokens, layers = parse_ft_spec(cfg.encoder)
    enc = FinetunedMiniLMEncoder(max_tokens, layers, adapters, threads=threads)
    rows = np.concatenate([bundle.splits[k] for k in ("calib", "test")])  # all calibration reads
    emb = np.zeros((len(bundle), FT_DIM), dtype=np.float32)
    emb[rows] = enc.encode_ids(bundle.seqs(rows), progress=progress)
    data = LengthData(
        emb, bundle.prompt_len, bundle.output_len, bundle.splits, enc.identity, bundle.dataset
    )
    rlp = calibrated_model(data, cfg, weights, history, coverage=coverage, adapters=adapters)
    rlp.meta["trained_on"] = device
    return rlp
