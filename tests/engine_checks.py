"""The engine executor's checked variant and an erratic policy, for the engine's fuzz
tests: an executor that checks every live sequence's KV against its books each step, a
policy that cancels, suspends, resumes, evicts and preempts at random, and the greedy
answer a prompt gets alone, which every untouched answer must equal."""

from __future__ import annotations

import random
from typing import Any

from duetime.core.decision import Decision
from duetime.core.request import Job, Request
from duetime.core.sequence import SeqStatus
from duetime.core.snapshot import EngineSnapshot
from duetime.engine import greedy_generate
from duetime.engine.executor import EngineExecutor
from duetime.engine.gemma3 import Gemma3
from duetime.policies.base import QueuePolicy

_REF: dict[tuple[int, tuple[int, ...], int], list[int]] = {}


def solo_answer(model: Gemma3, prompt: tuple[int, ...], n: int) -> list[int]:
    """The greedy answer of ``prompt`` run alone in one prefill (cached per model)."""
    key = (id(model), prompt, n)
    if key not in _REF:
        _REF[key] = greedy_generate(model, [list(prompt)], n)[0]
    return _REF[key]


def engine_job(rid: int, prompt: tuple[int, ...], output: int, **kw: Any) -> Job:
    """A job of ``prompt`` arriving at ``arrival`` (0), ``output`` tokens long, with its
    ``segments`` and ``gaps``; the other keywords go to its request."""
    segs = kw.pop("segments", ())
    gaps = kw.pop("gaps", ())
    arrival = kw.pop("arrival", 0.0)
    req = Request(rid=rid, arrival=arrival, prompt_len=len(prompt), prompt_token_ids=prompt, **kw)
    return Job(req, output, segs, gaps)


def random_prompt(r: random.Random, n: int) -> tuple[int, ...]:
    """``n`` random token ids below 256 (the tiny model's vocabulary)."""
    return tuple(r.randrange(256) for _ in range(n))


class CheckedEngine(EngineExecutor):
    """An engine executor that checks every live sequence's KV against the books each step."""

    spooled_at_close: dict[int, Any] | None = None

    def _check_kv(self) -> None:
        super()._check_kv()
        for rid, slot in self.slots.items():
            seq = self.seqs[rid]
            assert seq.status in (SeqStatus.RUNNING, SeqStatus.SUSPENDED), seq
            assert self.kv.num_tokens(slot) == seq.kv_tokens, (seq, self.kv.num_tokens(slot))
            fed = seq.prefilled if not seq.prefill_done else seq.context_len - 1
            assert self.kv.seq_len(slot) == fed, (seq, self.kv.seq_len(slot))
            if seq.prefill_done:
                assert len(self.tokens[rid]) == seq.context_len, seq
        for rid in self._spooled:
            seq = self.seqs[rid]
            assert seq.status is SeqStatus.SUSPENDED, seq
            assert seq.kv_offloaded, seq
            assert rid not in self.slots, seq
        for seq in self.seqs.values():
            holds = seq.status is SeqStatus.RUNNING or (
                seq.status is SeqStatus.SUSPENDED and seq.rid not in self._spooled
            )
            assert (seq.rid in self.slots) == holds, seq

    def close(self) -> None:
        self.spooled_at_close = dict(self._spooled)  # close() forgets them: look first
        super().close()


class EngineChaos(QueuePolicy):
    """FCFS plus random cancels, suspends, resumes, evictions and preemptions (seeded).

    Like ``test_sim_properties.ChaosPolicy``, but it also picks on waiting and
    suspended sequences, and evicts at ratios from 0 to 0.99. ``evicted`` is
    every request that lost KV (its text may change, not its length).
    """

    name = "engine-chaos"

    def __init__(self, seed: int, mode: str, p: float) -> None:
        super().__init__(preempt_mode=mode)  # type: ignore[arg-type]
        self.rng = random.Random(seed)
        self.p = p
        self.evicted: set[int] = set()

    def schedule(self, snap: EngineSnapshot) -> Decision:
        dec = super().schedule(snap)
        if not self.p:
            return dec
        touched = {rid for rid, _ in dec.prefill} | set(dec.preempt) | set(dec.cancel)
        touched |= set(dec.resume)
        r = self.rng
        running = {s.rid for s in snap.running}
        for s in [*snap.running, *snap.suspended, *snap.waiting]:
            if s.rid in touched:
                continue
            x = r.random() / self.p
            holds_kv = s.status in (SeqStatus.RUNNING, SeqStatus.SUSPENDED)
            if x < 0.2:
                dec.cancel.append(s.rid)
            elif x < 0.5 and s.rid in running and s.prefill_done:
                dec.suspend.append(s.rid)
            elif x < 0.7 and holds_kv and s.prefill_done:
                alpha = r.choice([0.0, 0.25, 0.5, 0.9, 0.99])
                dec.evict[s.rid] = alpha
                if int(alpha * s.kv_tokens):
                    self.evicted.add(s.rid)
                continue  # an evicted sequence may still be resumed below
            elif x < 1.0 and holds_kv:
                dec.preempt.append(s.rid)
            else:
                continue
            touched.add(s.rid)
        # Resume anything suspended (ready or not) in steps without other work, within limits.
        if not dec.prefill and not dec.resume:
            room = snap.max_num_seqs - len(snap.running)
            budget = snap.max_batch_tokens - snap.num_decoding
            free = snap.kv_free - snap.num_decoding
            for s in list(snap.suspended):
                need = s.kv_tokens + 1 if s.kv_offloaded else 1
                if s.rid in touched or room <= 0 or budget <= 0 or need > free:
                    continue
                if r.random() < 0.4 or not snap.running:
                    dec.resume.append(s.rid)
                    room, budget, free = room - 1, budget - 1, free - need
        return dec
