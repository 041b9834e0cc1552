"""The executor's prefix-cache books and the prefills a step shares.

Blocks go into the prefix cache as a prefill or a decoder completes them
(:meth:`PrefixBooks._offer_blocks`); an admitted sequence starts with the
cached blocks its prompt begins with (:meth:`PrefixBooks._prefix_hit`). Within
one step, chunks that start alike borrow each other's rows
(:meth:`PrefixBooks._share_prefills`): the cache cannot help there, since their
blocks exist only after the step.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from typing import Any

from duetime.core.executor_state import ExecutorState
from duetime.core.prefix_cache import DEFAULT_BLOCK_SIZE, ROOT_KEY, common_prefix_len
from duetime.core.sequence import Seq, SeqStatus


class PrefixBooks(ExecutorState):
    """Prefix caching and in-step prefill sharing, over the state of one run."""

    def _block_keys(self, seq: Seq, n_blocks: int) -> Iterator[Hashable]:
        """Keys of ``seq``'s first ``n_blocks`` blocks, one at a time (a lookup stops at
        its first miss)."""
        if self.prefix_cache is None:
            return
        size = self.prefix_cache.block_size
        parent: Hashable = ROOT_KEY
        for start in range(0, n_blocks * size, size):
            parent = self._block_key(seq, start, start + size, parent)
            yield parent

    def _hit_limit(self, seq: Seq) -> int:
        """The most of ``seq``'s prefill a hit may cover: all but the last
        ``prefix_compute_tail`` tokens (the last one's logits give the next token; the
        engine under SnapKV needs its query window's too)."""
        return max(0, seq.prefill_target - self.prefix_compute_tail)

    def _lookup_hit(self, seq: Seq) -> int:
        """What :meth:`_prefix_hit` would find for ``seq`` now, in tokens, without
        counting or marking anything (the snapshot's ``prefix_hit``); 0 unless waiting."""
        cache = self.prefix_cache
        if cache is None or seq.status is not SeqStatus.WAITING:
            return 0
        hit = self._hit_memo.get(seq.rid)
        if hit is None:
            n_blocks = self._hit_limit(seq) // cache.block_size
            hit = self._hit_memo[seq.rid] = cache.peek(self._block_keys(seq, n_blocks))
        return hit

    def _prefix_hit(self, seq: Seq) -> list[Any]:
        """Look the prefill of a sequence about to be admitted up in the prefix cache:
        the payloads of the cached blocks it begins with (at most :meth:`_hit_limit`)."""
        cache = self.prefix_cache
        if cache is None:
            return []
        limit = self._hit_limit(seq)
        keys, payloads = cache.match(self._block_keys(seq, limit // cache.block_size), limit)
        self._chains[seq.rid] = (len(keys), keys[-1] if keys else ROOT_KEY)
        return payloads

    def _offer_blocks(self, chunks: list[tuple[Seq, int]]) -> None:
        """Offer the prefix cache every whole block a step (or a run of decode steps) just
        completed: of the prefill ``chunks``, and of the decoders due one (prompt and
        answer alike: a conversation's next turn begins with both). Decoders are found
        through a heap of the step each completes its next block at, so a run of steps
        costs the blocks it completes, not one look at every sequence a step."""
        if self.prefix_cache is None or not self._chains:
            return
        for seq, _ in chunks:
            if not seq.prefill_done:  # a finished prefill joined the decoders, below
                self._offer_seq(seq)
        due, steps = self._block_due, self.clock.steps
        size = self.prefix_cache.block_size
        while due and due[0][0] <= steps:
            at, _, epoch, seq = heapq.heappop(due)
            if seq.decoding and seq._epoch == epoch:
                # A run of several steps (the simulator's) completes a decoder's blocks a
                # block's worth of steps apart: offer those done before the next decoder's
                # is due, so that the blocks go in in the order a step at a time gives.
                until = steps if not due else min(steps, due[0][0] - 1)
                self._offer_seq(seq, most=1 + max(0, until - at) // size)
                self._push_block_due(seq)

    def _offer_seq(self, seq: Seq, most: int | None = None) -> None:
        """Offer every whole block (at most ``most``) of ``seq`` its KV holds that it has
        not offered yet."""
        chain = self._chains.get(seq.rid)
        cache = self.prefix_cache
        if chain is None or cache is None:
            return  # its KV is not its prefill's any more (evicted): it offers nothing
        size = cache.block_size
        done, parent = chain
        end = self._kv_positions(seq)
        if most is not None:
            end = min(end, (done + most) * size)
        while (done + 1) * size <= end:
            start = done * size
            key = self._block_key(seq, start, start + size, parent)
            if key not in cache:  # (reading a block's KV costs a copy: only when new)
                cache.insert(key, parent, self._block_payload(seq, start, start + size))
            parent, done = key, done + 1
        self._chains[seq.rid] = (done, parent)

    @staticmethod
    def _kv_positions(seq: Seq) -> int:
        """Positions a running sequence's KV holds (a decoder's newest token is produced
        but not yet fed back)."""
        return seq.req.prompt_len + seq.generated - 1 if seq.prefill_done else seq.prefilled

    def _push_block_due(self, seq: Seq) -> None:
        """A decoder with a chain: note the decode step it completes its next block at."""
        chain = self._chains.get(seq.rid)
        if chain is None or self.prefix_cache is None:
            return
        ahead = (chain[0] + 1) * self.prefix_cache.block_size - self._kv_positions(seq)
        heapq.heappush(self._block_due, (self.clock.steps + ahead, seq.order, seq._epoch, seq))

    def _drop_kv(self, seq: Seq) -> None:
        """The sequence's KV is gone for good: it offers the prefix cache nothing more."""
        self._chains.pop(seq.rid, None)
        self._on_drop_kv(seq)

    # --- prefills shared within a step -------------------------------------------
    def _share_prefills(self, chunks: list[tuple[Seq, int]]) -> None:
        """Let a chunk borrow the rows an earlier chunk of the same step computes.

        ``n > 1`` choices of one prompt, or a burst of requests behind one system
        prompt, are admitted together: the prefix cache cannot help (their blocks
        exist only after the step), so each would compute the same tokens. A chunk
        that starts where an earlier one does, after the same tokens, and goes on
        with the same tokens, takes those rows' keys and values from it and computes
        only the rest (at least its last token, whose logits it needs): its
        prefill still advances by its whole chunk, so policies see nothing but a
        cheaper step. Only rows of at least a block's worth
        (``DEFAULT_BLOCK_SIZE``) are borrowed, from a chunk that computes its own.
        """
        if self.borrowed:
            self.borrowed = {}
        if len(chunks) < 2 or not self.share_prefills:
            return
        if all(s.req.prompt_token_ids is None and s.req.prefix_group is None for s, _ in chunks):
            return  # nothing says any two prompts begin alike (what _share_key reads)
        # Chunks that can share begin alike where they start: bucketing them by that
        # first block keeps a step of k unrelated chunks at k lookups, not k² comparisons.
        leaders: dict[Hashable, list[tuple[Seq, int]]] = {}
        for seq, n in chunks:
            key = self._share_key(seq) if n > DEFAULT_BLOCK_SIZE else None
            if key is None:
                continue
            best, rows = None, 0
            if self._may_borrow(seq):
                start = seq.prefilled
                for lead, m in leaders.get(key, ()):
                    common = self._common_prompt(lead, seq, start + min(m, n - 1)) - start
                    if common >= DEFAULT_BLOCK_SIZE and common > rows:
                        best, rows = lead, common
            if best is None:
                leaders.setdefault(key, []).append((seq, n))
            else:
                self.borrowed[seq.rid] = (best.rid, rows)
                self.prefill_shared_tokens += rows

    @staticmethod
    def _share_key(seq: Seq) -> Hashable | None:
        """Where ``seq``'s prefill stands and the block of prompt it goes on with (its
        ids, or the shared prefix it names); None where no block of prompt is left."""
        req, start = seq.req, seq.prefilled
        end = start + DEFAULT_BLOCK_SIZE
        ids = req.prompt_token_ids
        if ids is not None:
            return (start, tuple(ids[start:end])) if end <= len(ids) else None
        if req.prefix_group is not None and end <= req.prefix_len:
            return (start, "group", req.prefix_group)
        return None

    def computed_rows(self, seq: Seq, n: int) -> int:
        """Rows the step's prefill chunk of ``n`` tokens of ``seq`` computes: all but
        those it borrows from another chunk."""
        lent = self.borrowed.get(seq.rid)
        return n if lent is None else n - lent[1]

    def _may_borrow(self, seq: Seq) -> bool:
        """Whether ``seq``'s prefill may take rows another chunk computes (the engine
        says no where it needs every row's own output)."""
        return True

    @staticmethod
    def _common_prompt(a: Seq, b: Seq, end: int) -> int:
        """How many first tokens the prompts of ``a`` and ``b`` agree on, at most
        ``end``: their ids where both requests carry them, else the shared prefix
        they both name (``prefix_group``); 0 where nothing says they agree."""
        ra, rb = a.req, b.req
        end = min(end, ra.prompt_len, rb.prompt_len)
        ia, ib = ra.prompt_token_ids, rb.prompt_token_ids
        if ia is not None and ib is not None:
            return common_prefix_len(ia, ib, end)
        if ra.prefix_group is not None and ra.prefix_group == rb.prefix_group:
            return min(end, ra.prefix_len, rb.prefix_len)
        return 0
