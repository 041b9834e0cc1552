"""A small learnable length-prediction set for the fine-tuned RLP's tests: the training
configuration cut to one MiniLM layer and 16 word pieces, prompts whose answers are
long when they ask for an essay, and their token bundle."""

from __future__ import annotations

import numpy as np

from duetime.predict.length_data import split_rows
from duetime.predict.length_features import MiniLMEncoder
from duetime.predict.length_model import RLPConfig
from duetime.predict.length_tokens import BUNDLE_TOKENS, TokenBundle, pack

CFG = RLPConfig(
    bucket_size=16,
    max_len=512,
    encoder="minilm-ft:16:1",
    hidden=16,
    dropout=0.0,
    epochs=4,
    batch_size=16,
    lr=3e-2,
    encoder_lr=1e-3,
    lora_rank=2,
)
TOPICS = ["rivers", "cats", "tax law", "jazz", "volcanoes", "chess", "bread", "satellites"]


def synthetic_texts(n: int = 160, seed: int = 0) -> tuple[list[str], np.ndarray]:
    """Prompts asking for an essay get ~400-token answers, the others ~24: a learnable signal."""
    rng = np.random.default_rng(seed)
    texts, out = [], []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        if i % 2:
            texts.append(f"write a long detailed essay about {topic} please")
            out.append(int(rng.integers(360, 440)))
        else:
            texts.append(f"say hi about {topic}")
            out.append(int(rng.integers(16, 32)))
    return texts, np.asarray(out)


def make_bundle(texts: list[str], out: np.ndarray) -> TokenBundle:
    """The texts as a token bundle split by pairs of rows, as `build_bundle` packs them."""
    ids, off = pack(MiniLMEncoder(BUNDLE_TOKENS, static=True).token_ids(texts))  # as build_bundle
    groups = np.asarray([f"c{i // 2}" for i in range(len(texts))])
    return TokenBundle(
        ids,
        off,
        np.asarray([len(t.split()) + 1 for t in texts]),
        out,
        split_rows(groups, seed=0, fractions=(0.5, 0.2, 0.15, 0.15)),
        "synthetic",
        "minilm-wordpiece",
    )
