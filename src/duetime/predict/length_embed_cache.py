"""The ShareGPT prompts' embeddings, built once per encoder and cached on disk.

Embedding all 17,322 ShareGPT prompts once takes minutes for the contextual
encoder, so :func:`sharegpt_embeddings` caches them under
:func:`duetime.tokenizer.cache_dir`, keyed by the encoder's identity and the
dataset's (path, size, mtime, token counter, rows). The cache also keeps a
64-bit hash of every prompt text, so a predictor handed one of those prompts
looks its vector up instead of running the encoder again.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from duetime.tokenizer import cache_dir
from duetime.workloads._files import atomic_writer, file_lock
from duetime.workloads.sharegpt import ShareGPTLengths, load_sharegpt_lengths, read_pairs

if TYPE_CHECKING:
    from duetime.predict.length_features import PromptEncoder

__all__ = [
    "cached_embeddings",
    "dataset_identity",
    "describe_cache",
    "sharegpt_embeddings",
    "sharegpt_prompts",
    "text_key",
]


def text_key(text: str) -> int:
    """A 64-bit hash of a prompt text (blake2b), to find it in a cached embedding matrix."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def dataset_identity(lengths: ShareGPTLengths) -> str:
    """Changes whenever the rows (or their token counts) could: file, counter and row count."""
    source = Path(lengths.source).resolve()
    st = source.stat()
    return f"{source}|{st.st_size}|{st.st_mtime_ns}|{lengths.tokenizer}|{len(lengths)}"


def sharegpt_prompts(
    lengths: ShareGPTLengths, rows: Sequence[int] | np.ndarray | None = None
) -> list[str]:
    """Prompt texts of ``rows`` (all rows by default), read by seeking into the data file."""
    picked = range(len(lengths)) if rows is None else rows
    return [prompt for prompt, _ in read_pairs(lengths, picked)]


_MEMORY: dict[str, tuple[np.ndarray, np.ndarray]] = {}


def sharegpt_embeddings(
    encoder: PromptEncoder,
    lengths: ShareGPTLengths | None = None,
    *,
    progress: bool = True,
    refresh: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """``(embeddings, text_keys)`` for every ShareGPT row, built once and cached on disk.

    ``embeddings`` is ``(rows, dim)`` float32 in row order; ``text_keys`` the
    uint64 :func:`text_key` of each prompt. Concurrent builders wait on a file
    lock, so the matrix is computed once.
    """
    lengths = lengths if lengths is not None else load_sharegpt_lengths(progress=progress)
    key, key_text, cache_file = _cache_key(encoder, lengths)
    if not refresh and key in _MEMORY:
        return _MEMORY[key]
    with file_lock(cache_dir() / "sharegpt-embed.lock"):
        found = None if refresh else _read_cache(cache_file, key_text)
        if found is None:
            texts = sharegpt_prompts(lengths)
            keys = np.asarray([text_key(t) for t in texts], dtype=np.uint64)
            emb = encoder.encode(texts, progress=progress).astype(np.float32)
            with atomic_writer(cache_file, binary=True) as f:
                np.savez(f, identity=np.asarray(key_text), embeddings=emb, text_keys=keys)
            found = (emb, keys)
    _MEMORY[key] = found
    return found


def _cache_key(encoder: PromptEncoder, lengths: ShareGPTLengths) -> tuple[str, str, Path]:
    key_text = f"{encoder.identity}|{dataset_identity(lengths)}"
    key = hashlib.sha1(key_text.encode()).hexdigest()[:16]
    return key, key_text, cache_dir() / f"sharegpt-embed-{key}.npz"


def _read_cache(cache_file: Path, key_text: str) -> tuple[np.ndarray, np.ndarray] | None:
    if not cache_file.exists():
        return None
    with suppress(Exception), np.load(cache_file, allow_pickle=False) as data:
        if str(data["identity"]) == key_text:
            return data["embeddings"], data["text_keys"]
    return None  # unreadable or stale: rebuilt by sharegpt_embeddings


def cached_embeddings(encoder: PromptEncoder) -> tuple[np.ndarray, np.ndarray] | None:
    """The bundled ShareGPT set's cached ``(embeddings, text_keys)``, or None; never builds."""
    try:
        lengths = load_sharegpt_lengths(progress=False)
    except (ImportError, OSError):
        return None
    key, key_text, cache_file = _cache_key(encoder, lengths)
    if key not in _MEMORY:
        found = _read_cache(cache_file, key_text)
        if found is None:
            return None
        _MEMORY[key] = found
    return _MEMORY[key]


def describe_cache(encoder: PromptEncoder, lengths: ShareGPTLengths) -> dict[str, str]:
    """What :func:`sharegpt_embeddings` keys its cache on (for reports)."""
    return {"encoder": encoder.identity, "dataset": dataset_identity(lengths)}
