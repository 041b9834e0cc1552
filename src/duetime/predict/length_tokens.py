"""The RLP's training data as word-piece ids: one small portable file.

Fine-tuning the encoder (``minilm-ft``) reads token ids, not frozen
embeddings. A :class:`TokenBundle` holds every ShareGPT prompt's MiniLM word
pieces (up to 512, ``[CLS]``/``[SEP]`` included, as the tokenizer truncates),
the Gemma token counts of prompt and answer, and the seeded split, in one
``.npz`` of ~2 MB. So the training can run on a machine that has a GPU but not
the ShareGPT package (``duetime predict export-length-data``, then
``train-length --bundle``), and every machine trains on the same rows.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from duetime.predict.length_data import SPLITS
from duetime.predict.npz_file import NpzKind

if TYPE_CHECKING:
    from duetime.predict.length_features import MiniLMEncoder
    from duetime.tokenizer import TokenCounter
    from duetime.workloads.sharegpt import ShareGPTLengths

BUNDLE_FORMAT = "duetime-rlp-tokens"
BUNDLE_VERSION = 1
BUNDLE_TOKENS = 512  # word pieces kept per prompt: BERT's position limit
#: The bundle's file kind: what its header must name, and how a refused file is named.
_BUNDLE_FILE = NpzKind(
    fmt=BUNDLE_FORMAT,
    version=BUNDLE_VERSION,
    what="duetime token bundle",
    fix="export it again with `duetime predict export-length-data`",
)


@dataclass(slots=True, eq=False)
class TokenBundle:
    """Word-piece ids of every row (ragged: ``ids[off[i]:off[i + 1]]``), labels and split."""

    ids: np.ndarray  # uint16, all rows concatenated
    off: np.ndarray  # int64, len(rows) + 1
    prompt_len: np.ndarray  # Gemma tokens, <bos> included
    output_len: np.ndarray  # Gemma tokens of the recorded answer
    splits: dict[str, np.ndarray]
    dataset: str  # identity of the rows (file, size, mtime, counter, count) and the split rule
    tokenizer: str

    def __len__(self) -> int:
        return len(self.prompt_len)

    @property
    def split_seed(self) -> int | None:
        """The seed its rows were split with, as :func:`build_bundle` records it in
        ``dataset``; None where it is not recorded (a bundle made otherwise)."""
        found = _SPLIT_TAG_SEED.search(self.dataset)
        return int(found.group(1)) if found else None

    def seqs(self, rows: np.ndarray) -> list[np.ndarray]:
        """The id sequence of each row, as int64."""
        return [self.ids[self.off[r] : self.off[r + 1]].astype(np.int64) for r in rows]

    def save(self, path: str | Path) -> Path:
        header = {
            "dataset": self.dataset,
            "tokenizer": self.tokenizer,
        }
        arrays = {
            "ids": self.ids,
            "off": self.off,
            "prompt_len": self.prompt_len,
            "output_len": self.output_len,
        } | {f"split_{k}": v for k, v in self.splits.items()}
        return _BUNDLE_FILE.save(path, header, arrays)

    @classmethod
    def load(cls, path: str | Path) -> TokenBundle:
        """Read a bundle; anything else (or another version) raises ``ValueError`` naming it."""
        header, data = _BUNDLE_FILE.load(path)
        try:
            bundle = cls(
                data["ids"],
                data["off"],
                data["prompt_len"],
                data["output_len"],
                {k: data[f"split_{k}"] for k in SPLITS},
                header["dataset"],
                header["tokenizer"],
            )
        except KeyError as e:
            raise ValueError(f"{path}: token bundle lacks {e}") from None
        if len(bundle.off) != len(bundle) + 1 or bundle.off[-1] != len(bundle.ids):
            raise ValueError(f"{path}: token bundle offsets do not match its ids")
        return bundle


# How build_bundle tags its rows' identity with the split, and how split_seed reads it back.
_SPLIT_TAG = "|split seed {seed}, max_len {max_len}"
_SPLIT_TAG_SEED = re.compile(r"\|split seed (\d+), max_len ")


def pack(seqs: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Ragged id sequences as (``ids`` uint16, all concatenated; ``off`` int64, len + 1)."""
    off = np.zeros(len(seqs) + 1, dtype=np.int64)
    off[1:] = np.cumsum([len(s) for s in seqs])
    ids = np.fromiter((i for s in seqs for i in s), dtype=np.uint16, count=int(off[-1]))
    return ids, off


def build_bundle(
    *, max_len: int, seed: int = 0, progress: bool = True, all_turns: bool = False
) -> TokenBundle:
    """Every ShareGPT row, tokenised for MiniLM, with the RLP's split (``length_fit``'s rule).

    ``all_turns`` adds the later pairs of the train conversations as train rows
    (:func:`with_later_turns`).
    """
    from duetime.predict.length_data import from_sharegpt, pair_keys
    from duetime.predict.length_features import MiniLMEncoder, dataset_identity, sharegpt_prompts
    from duetime.workloads import load_sharegpt_lengths

    lengths = load_sharegpt_lengths(progress=progress)
    rows = from_sharegpt(
        lengths,
        np.empty((len(lengths), 0), dtype=np.float32),
        max_len=max_len,
        seed=seed,
        content_keys=pair_keys(lengths),
    )
    tok = MiniLMEncoder(BUNDLE_TOKENS, static=True)
    ids, off = pack(tok.token_ids(sharegpt_prompts(lengths)))
    bundle = TokenBundle(
        ids,
        off,
        lengths.prompt_len.astype(np.int64),
        lengths.output_len.astype(np.int64),
        rows.splits,
        dataset_identity(lengths) + _SPLIT_TAG.format(seed=seed, max_len=max_len),
        tok.identity,
    )
    if all_turns:
        from duetime.tokenizer import get_token_counter

        bundle = with_later_turns(bundle, lengths, get_token_counter(), tok, max_len=max_len)
    return bundle


def with_later_turns(
    bundle: TokenBundle,
    lengths: ShareGPTLengths,
    counter: TokenCounter,
    words: MiniLMEncoder,
    *,
    max_len: int,
) -> TokenBundle:
    """``bundle`` plus every later pair of its ``train`` conversations, as more train rows.

    A ShareGPT row is a conversation's first pair (the workload's request); its
    later pairs (:func:`~duetime.workloads.sharegpt.later_pairs`) make the
    training rows 3.5x as many (31,397 more at seed 0) and lowered the fine-tuned RLP's
    validation MAE (docs/predictors.md). val / calib / test stay first pairs,
    so every figure is still measured on the requests the workload replays.
    Rows are appended in file order; answers outside ``[1, max_len]`` tokens
    are dropped, as :func:`~duetime.predict.length_data.from_sharegpt` drops them.
    ``counter`` must be the one that counted ``lengths``, and ``words`` the
    word-piece encoder that tokenised ``bundle``: new rows must read as the old.
    """
    from duetime.workloads.sharegpt import later_pairs

    if counter.identity != lengths.tokenizer:
        raise ValueError(
            f"token counter {counter.identity!r} is not the one the rows were counted with "
            f"({lengths.tokenizer!r})"
        )
    if words.identity != bundle.tokenizer:
        raise ValueError(
            f"word pieces of {words.identity!r} are not the bundle's ({bundle.tokenizer!r})"
        )
    pairs = later_pairs(lengths, bundle.splits["train"])
    prompt_len = counter.count([p for _, p, _ in pairs], add_bos=True).astype(np.int64)
    output_len = counter.count([a for _, _, a in pairs]).astype(np.int64)
    keep = np.flatnonzero((output_len >= 1) & (output_len <= max_len))
    new_ids, new_off = pack(words.token_ids([pairs[i][1] for i in keep]))
    splits = dict(bundle.splits)
    splits["train"] = np.concatenate([splits["train"], len(bundle) + np.arange(len(keep))])
    return TokenBundle(
        np.concatenate([bundle.ids, new_ids]),
        np.concatenate([bundle.off, bundle.off[-1] + new_off[1:]]),
        np.concatenate([bundle.prompt_len, prompt_len[keep]]),
        np.concatenate([bundle.output_len, output_len[keep]]),
        splits,
        f"{bundle.dataset}|all turns",
        bundle.tokenizer,
    )
