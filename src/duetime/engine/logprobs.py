"""Log-probabilities of an answer's tokens, for the API's ``logprobs`` / ``top_logprobs``.

They are the model's own distribution (a log-softmax of the step's logits row),
before any penalty or temperature, as vLLM reports them by default. Under the
``q8`` and ``fast`` dtypes the logits outside each row's 32 best are the int8
head's approximations (docs/engine-kernels.md), so the normaliser is approximate too.

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
    """One request's log-probabilities, one entry per answer position; with ``prompt``
    also one per prompt token after the first (``/v1/completions`` with ``echo``: how
    likely the model found the prompt, what evaluation harnesses score answers by).

    ``prompt_entries[i]`` is prompt token ``i + 1``, scored by the logits of position
    ``i``: the engine fills them during the prefill (every row of it, so such a
    request takes no prefix-cache hit), before the first answer token is published.
    """

    def __init__(self, top_n: int, *, prompt: bool = False) -> None:
        if not 0 <= top_n <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_n must be in [0, {MAX_TOP_LOGPROBS}], got {top_n}")
        self.top_n = top_n
        self.entries: list[TokenLogprob] = []
        self.prompt_entries: list[TokenLogprob] | None = [] if prompt else None

    def prompt_positions(self, start: int, end: int, prompt_len: int) -> range:
        """Positions in ``[start, end)`` whose logits score a prompt token not logged yet
        (none unless asked; a recomputed prefill finds them logged)."""
        if self.prompt_entries is None:
            return range(0)
        return range(max(start, len(self.prompt_entries)), min(end, prompt_len - 1))

    def prompt_done(self, prompt_len: int) -> bool:
        """Whether every prompt token this log wants is logged (True if none is asked)."""
        return self.prompt_entries is None or len(self.prompt_entries) >= prompt_len - 1

    def record_prompt(self, first: int, logits: torch.Tensor, tokens: list[int]) -> None:
        """Rows of logits for positions ``first, first + 1, ...`` scored ``tokens`` (the
        prompt tokens that follow each position)."""
        entries = self.prompt_entries
        if entries is None or first != len(entries) or len(tokens) != len(logits):
            raise ValueError(
                f"prompt rows from position {first} ({len(logits)} rows, {len(tokens)} "
                f"tokens) do not continue {None if entries is None else len(entries)} entries"
            )
        # (a whole log-softmax: torch.logsumexp is 3.5x slower on these rows, measured)
        lsm = torch.log_softmax(logits.detach().float(), dim=-1)
        chosen = lsm.gather(1, torch.tensor(tokens).view(-1, 1)).view(-1).tolist()
        if self.top_n:
            vals, ids = torch.topk(lsm, self.top_n, dim=-1)
            pairs = zip(ids.tolist(), vals.tolist(), strict=True)
            tops = [tuple(zip(i, v, strict=True)) for i, v in pairs]
        else:
            tops = [()] * len(tokens)
        entries.extend(
            TokenLogprob(t, lp, top) for t, lp, top in zip(tokens, chosen, tops, strict=True)
        )

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
