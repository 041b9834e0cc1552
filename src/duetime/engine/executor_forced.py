"""Structured outputs' forced runs on the engine: the tokens a grammar forces come
without the model, riding along in the next step as one chunk where memory and the
step's token budget allow (jump-forward), or taken at once where they end the answer."""

from __future__ import annotations

from typing import TYPE_CHECKING

from duetime.core.executor import ExecutorError
from duetime.core.sequence import Seq
from duetime.engine.executor_kv import EngineKV

if TYPE_CHECKING:
    from duetime.engine.grammar import TokenGrammar


class ForcedRuns(EngineKV):
    """Forced tokens queued per request, and where they ride or end the answer."""

    def grammar_complete(self, rid: int) -> bool:
        """Whether ``rid``'s answer is a whole sentence of its grammar (the grammar takes
        no more, and no token it forced is still to come)."""
        grammar = self.grammars.get(rid)
        return grammar is not None and grammar.finished and rid not in self._forced

    def _force_next(self, rid: int, grammar: TokenGrammar) -> None:
        """Queue the tokens ``rid``'s grammar forces from where it is (none queued yet)."""
        if rid not in self._forced and not grammar.finished:
            forced = grammar.take_forced()
            if forced:
                self._forced[rid] = forced

    def _next_forced(self, rid: int, grammar: TokenGrammar) -> int | None:
        """The next token ``rid``'s grammar forces (queued after the token before, or
        forced from its state now: an answer's first), or None where the next token is
        the model's to choose."""
        self._force_next(rid, grammar)
        queue = self._forced.get(rid)
        if not queue:
            return None
        tok = queue.pop(0)
        if not queue:
            del self._forced[rid]
        return tok

    def _jumpable(self, rid: int, queue: list[int]) -> bool:
        """Whether ``rid``'s forced run may skip steps: not where its tokens are logged or
        segmented one by one, replayed, or where its stop rule ends on one of them."""
        if rid in self.logprob_logs or rid in self.segmenters or rid in self._replay:
            return False
        rule = self.stop_tokens.get(rid)
        return rule is None or not any(t in rule.ids for t in queue)

    def _finish_forced_ends(self) -> list[tuple[int, int]]:
        """Answers whose forced run is their end (the grammar's last tokens, or the last
        ``max_tokens`` allows) take it now, with no step: the tokens added."""
        produced: list[tuple[int, int]] = []
        for rid, queue in list(self._forced.items()):
            seq = self.seqs[rid]
            if not seq.decoding or not self._jumpable(rid, queue):
                continue
            left = self.tokens_left(seq)
            last = self.grammars[rid].finished and len(queue) <= left
            if not (last or len(queue) >= left) or left < 1:
                continue
            k = min(len(queue), left)
            if not self.finish_with(rid, k):
                raise ExecutorError(f"request {rid}: its last {k} tokens did not fit")
            produced += [(rid, t) for t in self._take_forced(rid, queue, k, rides=False)]
        return produced

    def _ride_forced(self, decoders: list[Seq], prefill_tokens: int) -> dict[int, list[int]]:
        """Forced runs that ride along in this step (structured outputs' jump-forward):
        each decoder with one feeds its newest token and the run as one chunk, and the
        step's logits for it follow the run. Booked now, within the KV memory and the
        step's token budget the policy left; the rest ride later. Returns the tokens
        each decoder gained."""
        free = self.kv_capacity - self.kv_used - prefill_tokens - len(decoders)
        budget = self.max_batch_tokens - prefill_tokens - len(decoders)
        riding: dict[int, list[int]] = {}
        for seq in decoders:
            queue = self._forced.get(seq.rid)
            if not queue or not self._jumpable(seq.rid, queue):
                continue
            # (the step's own token still to come)
            k = min(len(queue), free, budget, self.tokens_left(seq) - 1)
            if k < 1:
                continue
            if not self.skip_ahead(seq.rid, k):  # (its KV: once this step has run)
                raise ExecutorError(f"request {seq.rid}: {k} forced tokens did not fit")
            riding[seq.rid] = self._take_forced(seq.rid, queue, k, rides=True)
            free -= k
            budget -= k
        return riding

    def _take_forced(self, rid: int, queue: list[int], k: int, *, rides: bool) -> list[int]:
        """Move the first ``k`` of ``rid``'s forced ``queue`` into its answer (the core
        has booked them; ``rides``: as rows of this step, not as its last tokens): the
        tokens moved."""
        take = queue[:k]
        self.tokens[rid].extend(take)
        del queue[:k]
        if not queue:
            del self._forced[rid]
        self.counters["forced_tokens_jumped"] = self.counters.get("forced_tokens_jumped", 0) + k
        self.jumped[rid] = self.jumped.get(rid, 0) + k
        if rides:
            self.rode[rid] = self.rode.get(rid, 0) + k
        return take
