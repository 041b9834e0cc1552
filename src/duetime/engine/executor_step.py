"""One engine step: the policy's chunks and every decoder batched into one forward,
each row's token picked (replayed, forced, drawn or the arg-max), then the core's books,
stops, forced ends and segment ends, and the tokens handed to whoever listens."""

from __future__ import annotations

import torch

from duetime.core.cost import chunk_attention
from duetime.core.sequence import Seq
from duetime.engine.batch import SeqChunk
from duetime.engine.executor_logits import LogitNeeds


class EngineStep(LogitNeeds):
    """One batched forward per step, and what follows from its tokens."""

    def _run_step(self, chunks: list[tuple[Seq, int]], prefill_only: bool = False) -> float:
        """One batched forward: prefill chunks plus one token for every decoder (none
        with ``prefill_only``: the decoders hold, as :class:`Decision` says)."""
        kv = self.kv
        model_chunks: list[SeqChunk] = []
        owners: list[tuple[Seq, bool]] = []  # (seq, produces a sampled token)
        borrowed = self.borrowed
        index: dict[int, int] = {}  # rid → its chunk's place in the step (a leader's)
        computed = 0  # prefill rows the model runs
        attn = 0.0  # and their attention work, as the model's kernels do it
        geometry: list[tuple[int, int]] = []  # each chunk's (rows computed, end)
        for seq, n in chunks:
            slot = self.slots[seq.rid]
            start = seq.prefilled
            end = start + n
            if borrowed and seq.rid in borrowed:
                leader, rows = borrowed[seq.rid]
                ids = self.tokens[seq.rid][start + rows : end]
                chunk = SeqChunk(slot, ids, kv.seq_len(slot), shared=rows, leader=index[leader])
            else:
                index[seq.rid] = len(model_chunks)
                chunk = SeqChunk(slot, self.tokens[seq.rid][start:end], kv.seq_len(slot))
            model_chunks.append(chunk)
            owners.append((seq, end >= seq.prefill_target))
            computed += len(chunk)
            attn += chunk_attention(len(chunk), end, self.attention)
            geometry.append((len(chunk), end))
        decoders = [] if prefill_only else [s for s in self.running.values() if s.decoding]
        if kv.watching:  # a first decode ends the time SnapKV's window is needed
            for seq in decoders:
                kv.unwatch(self.slots[seq.rid])
        riding: dict[int, list[int]] = {}
        if self._forced and self.jump_forward:
            riding = self._ride_forced(decoders, sum(n for _, n in chunks))
        kv_attended = 0
        for seq in decoders:
            slot = self.slots[seq.rid]
            fed = self.tokens[seq.rid][-1 - len(riding.get(seq.rid, ())) :]
            model_chunks.append(SeqChunk(slot, fed, kv.seq_len(slot)))
            owners.append((seq, True))
            kv_attended += kv.num_tokens(slot)
        scored = self._prompt_scoring(chunks)
        argmax_only, allowed = self._logit_needs(owners)
        t0 = self._clock()
        model = self.model
        if scored:
            hidden, batch = model.hidden_states(model_chunks, kv)
            last = hidden[batch.last_rows]
        # plain greedy rows read nothing but their arg-max, so no row of logits is made
        # (no row then has a sampler, grammar or log, the only readers of `logits` below)
        if argmax_only and allowed is None:
            picked = model.greedy(last) if scored else model.greedy_step(model_chunks, kv)
        else:
            if scored:
                logits = model.logits(last, argmax_only=argmax_only, allowed=allowed)
            else:
                logits = model.step(model_chunks, kv, argmax_only=argmax_only, allowed=allowed)
            picked = torch.argmax(logits, dim=-1)
        next_ids = picked.tolist()
        dt = self._clock() - t0  # the step's own time: scoring the prompt is the client's extra
        for seq, row, positions in scored:
            self._score_prompt(seq, hidden[row : row + len(positions)], positions)
        produced: list[tuple[int, int]] = []
        completed: list[int] = []  # answers whose grammar takes no more tokens
        replay, samplers, logprob_logs = self._replay, self.samplers, self.logprob_logs
        grammars = self.grammars
        for row, ((seq, sampled), tok) in enumerate(zip(owners, next_ids, strict=True)):
            if sampled:
                produced += [(seq.rid, t) for t in riding.get(seq.rid, ())]
                ids = self.tokens[seq.rid]
                position = len(ids) - seq.req.prompt_len  # of this token in the answer
                forced = self._replayed(seq, position) if replay and seq.rid in replay else None
                grammar = grammars.get(seq.rid) if grammars else None
                queued = None
                if forced is None and grammar is not None:
                    queued = self._next_forced(seq.rid, grammar)
                if forced is not None:
                    tok = forced  # no draw: the generator stays where the first run left it
                elif queued is not None:
                    tok = queued  # the grammar's only way on: no draw either
                elif grammar is not None or (samplers and seq.rid in samplers):
                    gathered = allowed is not None and allowed[row] is not None
                    tok = self._pick(seq, logits[row], grammar, tok, masked=gathered)
                if logprob_logs and seq.rid in logprob_logs:
                    logprob_logs[seq.rid].record(position, logits[row], int(tok))
                ids.append(int(tok))
                produced.append((seq.rid, int(tok)))
                if grammar is not None and (queued is not None or grammar.accept(tok)):
                    if queued is None and not (replay and seq.rid in replay):
                        self._force_next(seq.rid, grammar)  # so the whole run can jump
                    if grammar.finished and seq.rid not in self._forced:
                        completed.append(seq.rid)
                elif grammar is not None:
                    completed.append(seq.rid)  # a replayed token it refused: broken
        self.now = self._clock() - self._t0
        self._after_step(chunks, prefill_only)
        for rid in completed:
            self.finish_early(rid)
        if self.stop_tokens:
            for rid, tok in produced:
                rule = self.stop_tokens.get(rid)
                if rule is not None and rule.ends(tok, self.seqs[rid].generated):
                    self.finish_early(rid)
        if self._forced and self.jump_forward:  # after the stop rules: no run past a stop
            produced += self._finish_forced_ends()
        if self.segmenters:
            self._check_segments(produced)
        if self.on_tokens is not None and produced:
            self.on_tokens(produced)
        if self.check_accounting:
            self._check_kv()
        rode = sum(len(r) for r in riding.values())
        self.last_step = (dt, computed + rode, len(decoders), kv_attended, attn)
        self._log_step(computed, attn, len(decoders), kv_attended, dt, geometry)
        return dt

    def _check_segments(self, produced: list[tuple[int, int]]) -> None:
        """Suspend every request whose stop checker saw a segment end in its new token."""
        for rid, tok in produced:
            seg = self.segmenters.get(rid)
            if seg is None:
                continue
            gap = seg.add(tok)
            if gap is not None:
                self.end_segment(rid, gap)
