"""What a step's rows read of their logits, and what they do with them: the arg-max
alone, a grammar's allowed tokens gathered, or every logit for a sampler's draw or a
log of probabilities; a prompt's tokens scored where a log wants them (``echo`` with
``logprobs``), whose prefill then copies no rows."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from duetime.core.sequence import Seq
from duetime.engine.executor_forced import ForcedRuns

if TYPE_CHECKING:
    from duetime.engine.grammar import TokenGrammar


class LogitNeeds(ForcedRuns):
    """The logits each row needs, the token a sampler or grammar picks, prompt scores."""

    def _logit_needs(
        self, owners: list[tuple[Seq, bool]]
    ) -> tuple[bool, list[torch.Tensor | None] | None]:
        """What this step's rows read of their logits, for ``Gemma3.step``: whether the
        rows that need the whole vocabulary read only their arg-max (plain greedy:
        ``argmax_only``), and per row the token ids its grammar allows next where they
        are few (``allowed``; None when no row has such a grammar).

        A sampler's draw or a log of probabilities reads every logit, so it must be
        close to fp32; a grammar reads only what it allows, exact from a gather when
        they are at most ``grammar_gather_max``, else the masked whole row."""
        samplers, grammars, logs = self.samplers, self.grammars, self.logprob_logs
        if not (samplers or grammars or logs):
            return True, None
        argmax_only = True
        allowed: list[torch.Tensor | None] = [None] * len(owners)
        vocab = self.model.config.vocab_size
        for row, (seq, sampled) in enumerate(owners):
            rid = seq.rid
            if not sampled:
                continue
            grammar = grammars.get(rid) if grammars else None
            if grammar is not None and rid not in logs:
                ids = grammar.allowed_ids(self.grammar_gather_max)
                ids = ids[ids < vocab] if ids is not None else None
                if ids is not None and len(ids):
                    allowed[row] = ids
                    continue
            if grammar is not None or rid in samplers or rid in logs:
                argmax_only = False
        return argmax_only, allowed if any(ids is not None for ids in allowed) else None

    def _pick(
        self,
        seq: Seq,
        logits: torch.Tensor,
        grammar: TokenGrammar | None,
        best: int,
        *,
        masked: bool = False,
    ) -> int:
        """The token a request with a sampler or a grammar takes from its ``[vocab]`` row
        of ``logits`` (whose arg-max is ``best``): the sampler's draw (else the arg-max)
        among what the grammar allows. ``masked``: the row holds only what the grammar
        allows already (gathered: every other logit is −∞), so it is not masked again."""
        sampler = self.samplers.get(seq.rid)
        if sampler is None and (masked or (grammar is not None and grammar.allows(best))):
            return best  # the best of all is allowed, so it is the best of the allowed
        if grammar is not None and not masked:
            logits = grammar.mask(logits)
        if sampler is None:
            return int(torch.argmax(logits))
        return sampler.pick(logits, self.tokens[seq.rid], seq.req.prompt_len)

    def _prompt_scoring(self, chunks: list[tuple[Seq, int]]) -> list[tuple[Seq, int, range]]:
        """Prefill chunks whose rows score prompt tokens a log wants (``echo`` with
        ``logprobs``): each with the step row of its first such position and the positions."""
        logs = self.logprob_logs
        if not logs:
            return []
        out = []
        row = 0
        for seq, n in chunks:
            log = logs.get(seq.rid)
            if log is not None:  # (a scoring chunk borrows no rows: _may_borrow)
                start = seq.prefilled
                positions = log.prompt_positions(start, start + n, seq.req.prompt_len)
                if positions:
                    out.append((seq, row + positions.start - start, positions))
            row += self.computed_rows(seq, n)
        return out

    #: Rows of prompt logits computed at once (a row is the vocabulary: 1 MiB on Gemma).
    PROMPT_SCORE_ROWS = 64

    def _score_prompt(self, seq: Seq, hidden: torch.Tensor, positions: range) -> None:
        """Log how likely each prompt token was, from the hidden states of the positions
        before them, a few rows of logits at a time."""
        log = self.logprob_logs[seq.rid]
        ids = self.tokens[seq.rid]
        piece = self.PROMPT_SCORE_ROWS
        for a in range(0, len(positions), piece):
            b = min(a + piece, len(positions))
            first = positions.start + a
            tokens = ids[first + 1 : first + 1 + b - a]
            log.record_prompt(first, self.model.logits(hidden[a:b]), tokens)

    def _scores_prompt(self, seq: Seq) -> bool:
        """Whether ``seq``'s prefill still scores prompt tokens a log wants: then every
        position's own hidden state is read, so none may be copied, from the prefix
        cache (:meth:`_hit_limit`) or from another chunk (:meth:`_may_borrow`)."""
        log = self.logprob_logs.get(seq.rid)
        return log is not None and not log.prompt_done(seq.req.prompt_len)

    def _hit_limit(self, seq: Seq) -> int:
        return 0 if self._scores_prompt(seq) else super()._hit_limit(seq)

    def _may_borrow(self, seq: Seq) -> bool:
        return not self._scores_prompt(seq)
