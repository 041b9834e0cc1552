"""Log-probabilities of an answer's tokens, for the API's ``logprobs`` / ``top_logprobs``.

They are the model's own distribution (a log-softmax of the step's logits row),
before any penalty or temperature, as vLLM reports them by default. Under the
``q8`` and ``fast`` dtypes the logits outside each row's 32 best are the int8
head's approximations (docs/engine.md), so the normaliser is approximate too.

The engine thread appends one :class:`TokenLogprob` per answer position; the
server reads a position only after its token was published, so the list needs
no lock (CPython's ``list.append`` is atomic, and the token's hand-over across
threads orders the append before the read). A token replayed after a restart
keeps the entry the client may already have.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MAX_TOP_LOGPROBS", "LogprobLog", "TokenLogprob"]

#: Most alternatives a position may list (OpenAI's chat limit; completions allow 5).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The chosen token, its log-probability, and the ``top_n`` likeliest tokens."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, log-probability), likeliest first


class LogprobLog:
    """One request's log-probabilities, one entry per answer position."""

    def __init__(self, top_n: int) -> None:
        if not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_n must be in [0, {MAX_TOP_LOGPROBS}], got {top_n}")
        self.top_n = top_n
        self.entries: list[TokenLogprob] = []

    def record(self, position: int, logits: torch.Tensor, token: int) -> None:
        """Answer position ``position`` got ``token`` from this row of logits."""
        if position < len(self.entries):
            return  # replayed after a restart: the same token, an entry already given out
        if position != len(self.entries):
            raise ValueError(f"position {position} skips ahead of {len(self.entries)} entries")
        lsm = torch.log_softmax(logits.detach().float(), dim=-1)
        top: tuple[tuple[int, float], ...] = ()
        if self.top_n:
            vals, ids = torch.topk(lsm, self.top_n)
            top = tuple(zip(ids.tolist(), vals.tolist(), strict=True))
        self.entries.append(TokenLogprob(token, float(lsm[token]), top))
