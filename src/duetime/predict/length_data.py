"""The RLP's data: ShareGPT prompts with the length of the answer the dataset records.

The answers in ShareGPT were written by the model that is the "target LLM"
here (TimeBill distils the target model's own lengths), so the label of a
prompt is the Gemma-3 token count of its recorded answer (``output_len``).

Splits are by conversation: ShareGPT V3 cut long chats into elements named
``<id>_0``, ``<id>_1``, ..., which share a user and topic, so all elements of
one ``<id>`` land in the same split. ShareGPT also holds the same chat shared
twice under two ids: 6.4 % of the seed-0 test rows had their exact prompt and
answer length in train when only ids were grouped, which rewards memorising.
So rows whose (prompt, answer) text is identical join one group too
(:func:`merge_groups`). The split is a seeded permutation of those groups:
train / val (early stopping, readout choice) / calib (conformal scores only) /
test (every reported number).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from duetime.workloads.sharegpt import ShareGPTLengths

if TYPE_CHECKING:
    from duetime.workloads.sources import LengthCaps

SPLITS = ("train", "val", "calib", "test")
DEFAULT_FRACTIONS = (0.7, 0.1, 0.1, 0.1)
_PART = re.compile(r"_\d+$")


def conversation_groups(conv_id: np.ndarray) -> np.ndarray:
    """Group label per row: the conversation id without its ``_<k>`` part suffix."""
    return np.asarray([_PART.sub("", str(c)) for c in conv_id])


def merge_groups(groups: np.ndarray, content_keys: np.ndarray) -> np.ndarray:
    """Join every two groups that share a content key (connected components); one label per row.

    ``content_keys`` is one hashable key per row, equal for rows whose texts
    are the same chat shared twice. A row's label is the smallest member
    group's name, so the result is a deterministic function of the inputs.
    """
    from scipy.sparse import coo_matrix
    from scipy.sparse.csgraph import connected_components

    g_names, g = np.unique(groups, return_inverse=True)
    _, k = np.unique(content_keys, return_inverse=True)
    n_g = len(g_names)
    edges = coo_matrix((np.ones(len(g)), (g, n_g + k)), shape=(n_g + k.max() + 1,) * 2)
    _, comp = connected_components(edges, directed=False)
    first: dict[int, str] = {}
    for name, c in zip(g_names, comp[:n_g], strict=True):  # g_names is sorted
        first.setdefault(c, name)
    return np.asarray([first[c] for c in comp[g]])


def split_rows(
    groups: np.ndarray,
    seed: int = 0,
    fractions: tuple[float, ...] = DEFAULT_FRACTIONS,
    eligible: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
    """Row indices of each split; every group lands in exactly one split. Seeded.

    ``eligible`` (a boolean mask) drops rows before splitting.
    """
    if len(fractions) != len(SPLITS) or abs(sum(fractions) - 1) > 1e-9 or min(fractions) < 0:
        raise ValueError(f"need {len(SPLITS)} fractions >= 0 summing to 1, got {fractions}")
    rows = np.arange(len(groups)) if eligible is None else np.flatnonzero(eligible)
    uniq, inverse = np.unique(groups[rows], return_inverse=True)
    order = np.random.default_rng([seed, 7]).permutation(len(uniq))
    rank = np.empty(len(uniq), dtype=np.int64)
    rank[order] = np.arange(len(uniq))
    edges = np.round(np.cumsum((0.0, *fractions)) * len(uniq)).astype(np.int64)
    which = np.searchsorted(edges, rank[inverse], side="right") - 1
    return {name: rows[which == i] for i, name in enumerate(SPLITS)}


@dataclass(slots=True, eq=False)
class LengthData:
    """Everything the RLP and its baselines learn from, one row per ShareGPT pair."""

    emb: np.ndarray  # (n, dim) prompt embeddings
    prompt_len: np.ndarray  # Gemma tokens, <bos> included (as Request.prompt_len)
    output_len: np.ndarray  # Gemma tokens of the recorded answer
    splits: dict[str, np.ndarray]
    encoder: str
    dataset: str

    def part(self, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(emb, prompt_len, output_len) of one split."""
        rows = self.splits[name]
        return self.emb[rows], self.prompt_len[rows], self.output_len[rows]

    def subset(self, n: int, seed: int = 0) -> LengthData:
        """At most ``n`` rows of each split (for quick tests), seeded."""
        rng = np.random.default_rng([seed, 11])
        splits = {
            k: np.sort(rng.choice(v, size=min(n, len(v)), replace=False))
            for k, v in self.splits.items()
        }
        return LengthData(
            self.emb, self.prompt_len, self.output_len, splits, self.encoder, self.dataset
        )


def from_sharegpt(
    lengths: ShareGPTLengths,
    emb: np.ndarray,
    *,
    max_len: int,
    seed: int = 0,
    encoder: str = "",
    dataset: str = "",
    content_keys: np.ndarray | None = None,
) -> LengthData:
    """Rows whose answer fits ``max_len`` (N_model), split by conversation.

    ``content_keys`` (see :func:`merge_groups`; :func:`pair_keys` reads them)
    also keeps duplicated chats together.
    """
    eligible = (lengths.output_len >= 1) & (lengths.output_len <= max_len)
    groups = conversation_groups(lengths.conv_id)
    if content_keys is not None:
        groups = merge_groups(groups, content_keys)
    splits = split_rows(groups, seed, eligible=eligible)
    return LengthData(
        emb, lengths.prompt_len, lengths.output_len, splits, encoder=encoder, dataset=dataset
    )


def heldout_rows(lengths: ShareGPTLengths, *, seed: int = 0, max_len: int = 4096) -> np.ndarray:
    """The ``test`` rows of the RLP's split at ``seed``: no shipped length model trained on them."""
    empty = np.empty((len(lengths), 0), dtype=np.float32)
    data = from_sharegpt(
        lengths, empty, max_len=max_len, seed=seed, content_keys=pair_keys(lengths)
    )
    return data.splits["test"]


def heldout_pool(lengths: ShareGPTLengths, caps: LengthCaps) -> np.ndarray:
    """The rows of :func:`heldout_rows` that fit ``caps``: what a benchmark of a learned
    predictor draws its jobs from, each row once (as many jobs as there are rows)."""
    fits = np.flatnonzero(caps.mask(lengths.prompt_len, lengths.output_len))
    return np.intersect1d(heldout_rows(lengths), fits)


_PAIR_KEYS: dict[str, np.ndarray] = {}


def pair_keys(lengths: ShareGPTLengths) -> np.ndarray:
    """A 64-bit hash of each row's (prompt, answer) text: equal for a chat shared twice.

    Reading every pair takes ~0.3 s, and a sweep builds its workload once per
    run, so the keys are kept per dataset identity for the process.
    """
    import hashlib

    from duetime.predict.length_features import dataset_identity
    from duetime.workloads.sharegpt import read_pairs

    ident = dataset_identity(lengths)
    if ident in _PAIR_KEYS:
        return _PAIR_KEYS[ident]
    out = np.empty(len(lengths), dtype=np.uint64)
    for i, (prompt, answer) in enumerate(read_pairs(lengths, range(len(lengths)))):
        h = hashlib.blake2b(digest_size=8)
        h.update(prompt.strip().encode("utf-8"))
        h.update(b"\0")
        h.update(answer.strip().encode("utf-8"))
        out[i] = int.from_bytes(h.digest(), "little")
    out.flags.writeable = False  # shared by every caller
    _PAIR_KEYS[ident] = out
    return out
