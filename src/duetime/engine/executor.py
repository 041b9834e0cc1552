"""The real executor: the shared state machine driving one batched Gemma 3 forward per step.

It is :class:`~duetime.core.executor.ExecutorCore` (the very code the
simulator runs) plus four things only a real engine has: token ids, KV-cache
slots that mirror the core's token accounting, the wall clock, and a model
forward in place of a cost model. Policies see the identical snapshot.

The engine asks the policy every step (nano-vllm's loop: schedule → run →
post-process); it cannot jump over steps the way the simulator does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import torch

from duetime.core.cost import LinearStepCost
from duetime.core.executor import ExecutorCore, ExecutorError
from duetime.core.policy import Policy
from duetime.core.prefix_cache import block_key, id_keys
from duetime.core.record import RequestRecord
from duetime.core.request import Job
from duetime.core.sequence import Seq
from duetime.engine.batch import SeqChunk
from duetime.engine.eviction import (
    DEFAULT_WINDOW,
    EVICTION_METHODS,
    snapkv_evict,
    streaming_llm_evict,
)
from duetime.engine.gemma3 import Gemma3
from duetime.engine.logprobs import LogprobLog
from duetime.engine.sampling import Sampler
from duetime.engine.segment_stop import TextSegmenter

if TYPE_CHECKING:
    from duetime.engine.grammar import TokenGrammar

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
#: Most tokens a grammar may allow next for its row to take their logits from a gather
#: of their output rows instead of the whole vocabulary's product (4,096 rows of
#: Gemma's 640 are 10 MB of fp32, against 168 MB for the int8 ranking).
GRAMMAR_GATHER_MAX = 4096


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except OSError:
        return 0


@dataclass(frozen=True, slots=True)
class StopRule:
    """Token ids that end a request's answer once it holds ``min_tokens`` tokens: its
    end-of-sequence (unless it ignores it) and any a client named (vLLM's
    ``stop_token_ids``). The ending token is part of the answer."""

    ids: frozenset[int]
    min_tokens: int = 0

    def ends(self, token: int, generated: int) -> bool:
        """Whether ``token``, the ``generated``-th of the answer, ends it."""
        return token in self.ids and generated >= self.min_tokens


@dataclass(slots=True)
class EngineResult:
    """Records, generated ids and counters of one engine run."""

    records: list[RequestRecord]
    outputs: dict[int, list[int]]
    wall_s: float
    engine_steps: int
    policy_calls: int
    preemptions: int
    kv_peak: int
    tokens_generated: int
    counters: dict[str, int] = field(default_factory=dict)


class EngineExecutor(ExecutorCore):
    """Serves jobs on a :class:`Gemma3` model under a policy, in real time.

    ``kv_capacity`` is the KV budget M in tokens, enforced by the same
    accounting the simulator uses and checked against the cache after every
    step (``check_accounting``). ``segmenters[rid]`` (a
    :class:`~duetime.engine.segment_stop.TextSegmenter`) ends that request's
    segments where its generated text says, for jobs without trace-given
    segments. ``samplers[rid]`` (a :class:`~duetime.engine.sampling.Sampler`)
    draws that request's tokens; every other request takes the arg-max.
    ``logprob_logs[rid]`` (a :class:`~duetime.engine.logprobs.LogprobLog`)
    receives the log-probabilities of that request's tokens. ``grammars[rid]`` (a
    :class:`~duetime.engine.grammar.TokenGrammar`) masks that request's tokens to what
    its grammar allows and ends its answer where the grammar is complete; tokens the
    grammar forces come without the model and ride along in the next step as one
    chunk where memory allows (``jump_forward``, on by default). With
    ``offload_suspended`` a suspended sequence's KV is spooled to disk when a
    step needs its room (see ``core/executor.py``). ``cost`` is the fitted
    profile handed to policies as ``snapshot.cost`` (None until `duetime
    profile` has run).
    ``telemetry`` receives one JSON line per step.

    ``eviction`` is how KV is dropped when a policy asks for ratio α:
    ``"snapkv"`` (default; SnapKV, what TimeBill uses) or ``"streaming"``
    (StreamingLLM sinks + recent window). Under SnapKV every sequence's last
    ``snapkv_window`` prefill queries are kept from admission until its first
    decode or eviction (2.4 MB per prefilling sequence on Gemma 3 270M at
    w = 32, fp32); a sequence evicted after its first decode no longer has them
    and falls back to StreamingLLM (counted in ``counters["snapkv_fallbacks"]``).

    ``prefix_cache_tokens`` > 0 keeps the KV of that many prompt tokens, in blocks,
    for later prompts that begin the same way (:mod:`~duetime.core.prefix_cache`):
    a request admitted with a cached beginning copies its KV and prefills the rest
    (``prefill_cached_tokens`` counts them). Its own budget, off the policy's books.
    A hit leaves the last token to compute (its logits give the first answer token),
    and under SnapKV the last ``snapkv_window``, whose queries SnapKV scores keys by.

    ``share_prefills`` (default on): prefill chunks of one step that start with the
    same tokens (``n`` > 1 choices, a burst behind one system prompt) compute them
    once; the others copy those rows' keys and values from the first
    (``ExecutorCore._share_prefills``; ``prefill_shared_tokens`` counts them).

    Each step tells the model what its rows read of their logits
    (:meth:`_logit_needs`): a plain greedy row only its arg-max (the vocabulary
    may be ranked in int4), a grammar row whose next tokens are at most
    ``grammar_gather_max`` only theirs (exact, from a gather of their output rows;
    0 turns that off), a sampler's or a logprob log's row every logit.

    ``skip_idle`` is for benchmarks that replay a trace: when nothing can run
    until the next arrival or ready time, the run's clock jumps there instead
    of sleeping (:attr:`idle_skipped_s` adds up the jumps). Every step is still
    timed on the wall clock, so a run costs its compute time, not the trace's
    length. A server never sets it.
    """

    def __init__(
        self,
        policy: Policy,
        model: Gemma3,
        *,
        kv_capacity: int = 32_768,
        max_num_seqs: int = 64,
        max_batch_tokens: int = 2048,
        predictor: Any = None,
        cost: LinearStepCost | None = None,
        telemetry: str | Path | None = None,
        check_accounting: bool = True,
        clock: Callable[[], float] = time.perf_counter,
        offload_suspended: bool = False,
        eviction: str = "snapkv",
        snapkv_window: int = DEFAULT_WINDOW,
        skip_idle: bool = False,
        prefix_cache_tokens: int = 0,
        share_prefills: bool = True,
        grammar_gather_max: int = GRAMMAR_GATHER_MAX,
    ) -> None:
        if eviction not in EVICTION_METHODS:
            raise ValueError(
                f"eviction must be one of {', '.join(EVICTION_METHODS)}, not {eviction!r}"
            )
        if snapkv_window < 1:
            raise ValueError(f"snapkv_window must be >= 1, got {snapkv_window}")
        super().__init__(
            policy,
            kv_capacity=kv_capacity,
            max_num_seqs=max_num_seqs,
            max_batch_tokens=max_batch_tokens,
            predictor=predictor,
            offload_suspended=offload_suspended,
            prefix_cache_tokens=prefix_cache_tokens,
            # SnapKV scores the prompt's keys by its last queries: a hit leaves them
            prefix_compute_tail=snapkv_window if eviction == "snapkv" else 1,
            share_prefills=share_prefills,
        )
        self.model = model
        self.kv = model.new_kv_cache()
        if self.prefix_cache is not None:
            # a block that began in an earlier step is still held when it is offered
            self.kv.keep_extra = self.prefix_cache.block_size - 1
        self.eviction = eviction
        self.snapkv_window = snapkv_window
        self.cost = cost
        self.check_accounting = check_accounting
        self._clock = clock
        self._t0 = clock()
        self.skip_idle = skip_idle
        self.idle_skipped_s = 0.0
        self.tokens: dict[int, list[int]] = {}  # prompt ids + generated ids
        # A restarted answer, to be made again token for token (see _on_restart).
        self._replay: dict[int, list[int]] = {}
        self.slots: dict[int, int] = {}
        self._telemetry_path = Path(telemetry) if telemetry is not None else None
        self._telemetry: IO[str] | None = None
        self._spool: Path | None = None  # where swapped-out KV waits (created on first use)
        self._spooled: dict[int, Path] = {}
        # Online serving: requests that end at end-of-sequence, and who hears each new token.
        self.eos_token_id: int | None = model.config.eos_token_id
        # rid → the tokens that end its answer (EOS, a client's stop ids), from min_tokens on
        self.stop_tokens: dict[int, StopRule] = {}
        self.last_step: tuple[float, int, int, int] | None = None  # (s, prefill, decoders, kv)
        self.on_tokens: Callable[[list[tuple[int, int]]], None] | None = None
        # Segmented generation by text (TimelyLLM's stop checker): rid → its checker.
        self.segmenters: dict[int, TextSegmenter] = {}
        # Requests that sample instead of taking the arg-max: rid → its seeded sampler.
        self.samplers: dict[int, Sampler] = {}
        # Requests that asked for their tokens' log-probabilities: rid → where they go.
        self.logprob_logs: dict[int, LogprobLog] = {}
        # Structured outputs: rid → the grammar its answer's tokens are masked to.
        self.grammars: dict[int, TokenGrammar] = {}
        # a grammar row allowing at most this many next tokens gets only their logits
        # (0: every grammar row gets the whole vocabulary's, masked)
        self.grammar_gather_max = grammar_gather_max
        # rid → tokens its grammar forces next (already past the grammar), not yet in the
        # answer: they come before any other, and ride along in one chunk where room allows.
        self._forced: dict[int, list[int]] = {}
        self.jump_forward = True  # False: forced tokens one a step, as chosen ones
        # rid → forced tokens its answer took without a step of their own (jumped), so a
        # server can learn how many steps a grammar's answers really take
        self.jumped: dict[int, int] = {}
        # rid → those of its jumped tokens that rode along as rows of a step (the rest, a
        # last forced run, are never fed back): the work a forecast adds to its steps
        self.rode: dict[int, int] = {}

    def step_cost_model(self) -> LinearStepCost | None:
        return self.cost

    # --- arrivals and KV hooks -------------------------------------------------
    def admit_arrival(self, job: Job) -> None:
        ids = job.request.prompt_token_ids
        if ids is None or len(ids) != job.request.prompt_len:
            raise ValueError(
                f"request {job.request.rid}: the engine needs prompt_token_ids of length "
                f"prompt_len={job.request.prompt_len}"
            )
        # The core refuses a duplicate id; only then may the ids be stored, or a live
        # request with that id would go on decoding from the newcomer's prompt.
        super().admit_arrival(job)
        self.tokens[job.request.rid] = list(ids)

    def cached_prefix_len(self, ids: Sequence[int]) -> int:
        """Prompt tokens of ``ids`` the prefix cache would supply if admitted now (0
        without a cache): for estimates, such as the server's admission control."""
        cache = self.prefix_cache
        if cache is None:
            return 0
        return cache.peek(id_keys(ids, len(ids) - self.prefix_compute_tail, cache.block_size))

    def _on_admit(self, seq: Seq, prefix: list[Any]) -> int:
        slot = self.slots[seq.rid] = self.kv.allocate(seq.prefill_target + 16)
        cached = self.kv.load_prefix(slot, prefix)
        if self.eviction == "snapkv":
            self.kv.watch(slot, self.snapkv_window)  # the prefill's last queries, for SnapKV
        return cached

    def _block_key(self, seq: Seq, start: int, end: int, parent: Hashable) -> Hashable:
        """Every token is known here (prompt and answer): a block's key hashes them."""
        assert isinstance(parent, bytes)
        return block_key(parent, self.tokens[seq.rid][start:end])

    def _block_payload(self, seq: Seq, start: int, end: int) -> torch.Tensor:
        """The block's K/V, all layers. One that began in an earlier step is still held,
        since sliding layers keep ``block_size - 1`` entries more than their window."""
        return self.kv.read_positions(self.slots[seq.rid], start, end)

    def _on_drop_kv(self, seq: Seq) -> None:
        slot = self.slots.pop(seq.rid, None)
        if slot is not None:
            self.kv.free(slot)
        spooled = self._spooled.pop(seq.rid, None)
        if spooled is not None:
            spooled.unlink(missing_ok=True)

    def _on_restart(self, seq: Seq) -> None:
        """The answer so far is void for the books (its KV is gone, it is generated again),
        but a client may have it already: the new run replays those tokens instead of
        sampling them, so the answer cannot change under it when a different batch
        (other float rounding, a near-tie) would pick another token. The steps, time
        and memory are those of generating them."""
        ids = self.tokens[seq.rid]
        answer = ids[seq.req.prompt_len :]
        if len(answer) > len(self._replay.get(seq.rid, ())):
            self._replay[seq.rid] = answer
        del ids[seq.req.prompt_len :]
        seg = self.segmenters.get(seq.rid)
        if seg is not None:
            seg.reset()
        grammar = self.grammars.get(seq.rid)
        if grammar is not None:
            grammar.reset()  # the replayed tokens take it through the answer again
            self._forced.pop(seq.rid, None)  # forced again once the replay is through
            self.jumped.pop(seq.rid, None)  # (the replay takes a step a token)
            self.rode.pop(seq.rid, None)

    def _on_swap_out(self, seq: Seq) -> None:
        """Spool the sequence's KV to disk: on a CPU engine, KV memory *is* RAM."""
        slot = self.slots.pop(seq.rid)
        path = self._spool_dir() / f"{seq.rid}.pt"
        torch.save(self.kv.export(slot), path)
        self._spooled[seq.rid] = path

    def _on_swap_in(self, seq: Seq) -> None:
        path = self._spooled.pop(seq.rid)
        self.slots[seq.rid] = self.kv.restore(torch.load(path, weights_only=True))
        path.unlink()

    def _spool_dir(self) -> Path:
        if self._spool is None:
            self._spool = Path(tempfile.mkdtemp(prefix="duetime-kv-"))
        return self._spool

    def _on_evict(self, seq: Seq, n_tokens: int, alpha: float) -> None:
        if seq.rid in self._spooled:  # swapped out: bring it back, evict, spool it again
            self._on_swap_in(seq)
            self._evict_slot(self.slots[seq.rid], n_tokens)
            self._on_swap_out(seq)
        else:
            self._evict_slot(self.slots[seq.rid], n_tokens)

    def _evict_slot(self, slot: int, n_tokens: int) -> None:
        kv = self.kv
        if self.eviction == "snapkv" and kv.obs_window(slot) is not None:
            snapkv_evict(kv, slot, n_tokens, window=self.snapkv_window)
        else:
            if self.eviction == "snapkv" and n_tokens:
                self.counters["snapkv_fallbacks"] = self.counters.get("snapkv_fallbacks", 0) + 1
            streaming_llm_evict(kv, slot, n_tokens)
        kv.unwatch(slot)  # one eviction per prefill: the window's memory goes now

    # --- one step ----------------------------------------------------------------
    def _run_step(self, chunks: list[tuple[Seq, int]], prefill_only: bool = False) -> float:
        """One batched forward: prefill chunks plus one token for every decoder (none
        with ``prefill_only``: the decoders hold, as :class:`Decision` says)."""
        kv = self.kv
        model_chunks: list[SeqChunk] = []
        owners: list[tuple[Seq, bool]] = []  # (seq, produces a sampled token)
        borrowed = self.borrowed
        index: dict[int, int] = {}  # rid → its chunk's place in the step (a leader's)
        computed = attn = 0  # prefill rows the model runs, and their attention n·(past + n)
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
            attn += len(chunk) * end
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
        if scored:
            hidden, batch = self.model.hidden_states(model_chunks, kv)
            last = hidden[batch.last_rows]
            logits = self.model.logits(last, argmax_only=argmax_only, allowed=allowed)
        else:
            logits = self.model.step(model_chunks, kv, argmax_only=argmax_only, allowed=allowed)
        next_ids = torch.argmax(logits, dim=-1).tolist()
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
        self.last_step = (dt, computed + rode, len(decoders), kv_attended)
        self._log_step(computed, attn, len(decoders), kv_attended, dt)
        return dt

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

    def _check_segments(self, produced: list[tuple[int, int]]) -> None:
        """Suspend every request whose stop checker saw a segment end in its new token."""
        for rid, tok in produced:
            seg = self.segmenters.get(rid)
            if seg is None:
                continue
            gap = seg.add(tok)
            if gap is not None:
                self.end_segment(rid, gap)

    def _check_kv(self) -> None:
        held = sum(self.kv.num_tokens(s) for s in self.slots.values())
        if held != self.kv_device:
            raise ExecutorError(
                f"KV accounting drifted: cache holds {held} tokens, executor counts "
                f"{self.kv_device}"
            )

    def _log_step(self, computed: int, attn: int, n_dec: int, kv: int, dt: float) -> None:
        if self._telemetry_path is None:
            return
        if self._telemetry is None:
            self._telemetry_path.parent.mkdir(parents=True, exist_ok=True)
            self._telemetry = self._telemetry_path.open("w")
        row = {
            "t_s": round(self.now, 6),
            "step_s": round(dt, 6),
            "prefill_tokens": computed,  # less rows borrowed from another chunk
            "prefill_attn": attn,
            "decode_seqs": n_dec,
            "kv_tokens_attended": kv,
            "kv_used_tokens": self.kv_used,
            "rss_bytes": rss_bytes(),
        }
        self._telemetry.write(json.dumps(row) + "\n")

    # --- main loop -----------------------------------------------------------------
    def run(self, jobs: Iterable[Job], *, max_wall_s: float = float("inf")) -> EngineResult:
        """Serve ``jobs`` (arrival times are seconds from now) until all are done."""
        pending = sorted(jobs, key=lambda j: (j.request.arrival, j.request.rid))
        n_jobs, i = len(pending), 0
        self._t0 = self._clock()
        self.now = 0.0
        idle_calls = 0
        try:
            while True:
                self.now = self._clock() - self._t0
                while i < n_jobs and pending[i].request.arrival <= self.now:
                    self.admit_arrival(pending[i])
                    i += 1
                if not self.in_system:
                    if i >= n_jobs:
                        break
                    self._sleep_until(pending[i].request.arrival)
                    continue
                if self.now > max_wall_s:
                    break
                nxt = self.tick()
                if nxt is None:
                    idle_calls = 0
                    continue
                if nxt < 0:
                    idle_calls += 1
                    if idle_calls > 10_000:
                        raise ExecutorError(
                            f"policy {self.policy.name!r} changed state 10,000 times "
                            "without letting the engine run a step"
                        )
                    continue
                nxt = min(nxt, pending[i].request.arrival if i < n_jobs else float("inf"))
                if nxt == float("inf"):
                    raise ExecutorError(
                        f"policy {self.policy.name!r} scheduled nothing with "
                        f"{len(self.waiting)} waiting and {len(self.suspended)} suspended "
                        "requests and no future event: the run would never end"
                    )
                self._sleep_until(nxt)
        finally:
            self.close()
        return EngineResult(
            records=[self.records[j.request.rid] for j in pending if j.request.rid in self.records],
            outputs={
                rid: toks[self.seqs[rid].req.prompt_len :] for rid, toks in self.tokens.items()
            },
            wall_s=self.now,
            engine_steps=self.engine_steps,
            policy_calls=self.policy_calls,
            preemptions=self.preemptions,
            kv_peak=self.kv_peak,
            tokens_generated=self.tokens_generated,
            counters=dict(self.counters),
        )

    def tick(self) -> float | None:
        """One scheduling round: ask the policy, apply its decision, run a step if any.

        Returns None when a step ran, -1.0 when the decision changed state but
        ran nothing (ask again at once), else the time of the next event the
        executor knows of (a suspended segment's ready time, the policy's
        ``wake_at``; ``inf`` if none) — the caller adds arrivals it knows of.
        """
        # Time moves while nothing runs (a server waiting for a segment's ready time).
        self.now = self._clock() - self._t0
        dec = self.policy.schedule(self.snapshot())
        self.policy_calls += 1
        chunks = self._apply(dec)
        self._check_limits(chunks, dec.prefill_only)
        if chunks or self._n_dec:
            self._run_step(chunks, dec.prefill_only)
            return None
        if not dec.is_empty():
            return -1.0
        return min(
            min((s.ready_at for s in self.suspended.values()), default=float("inf")),
            dec.wake_at if dec.wake_at is not None else float("inf"),
        )

    def clock_now(self) -> float:
        """Seconds since the run started, on the executor's clock."""
        return self._clock() - self._t0

    def start_clock(self, origin: float | None = None) -> None:
        """Start the executor's clock at zero now, or at ``origin`` (another executor's start)."""
        self._t0 = self._clock() if origin is None else origin
        self.now = self._clock() - self._t0

    @property
    def clock_origin(self) -> float:
        return self._t0

    def _replayed(self, seq: Seq, index: int) -> int | None:
        """Token ``index`` of ``seq``'s answer as made before its restart; None past it."""
        before = self._replay[seq.rid]
        if index >= len(before):
            del self._replay[seq.rid]
            return None
        if index == len(before) - 1:
            del self._replay[seq.rid]
        return before[index]

    def forget(self, rid: int) -> None:
        super().forget(rid)
        self.tokens.pop(rid, None)
        self._replay.pop(rid, None)
        self.stop_tokens.pop(rid, None)
        self.segmenters.pop(rid, None)
        self.samplers.pop(rid, None)
        self.logprob_logs.pop(rid, None)
        self.grammars.pop(rid, None)
        self._forced.pop(rid, None)
        self.jumped.pop(rid, None)
        self.rode.pop(rid, None)

    def close(self) -> None:
        """Remove swapped-out KV files and close the telemetry file."""
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
            self._spool, self._spooled = None, {}
        if self._telemetry is not None:
            self._telemetry.close()
            self._telemetry = None

    def _sleep_until(self, t: float) -> None:
        delay = t - (self._clock() - self._t0)
        if delay <= 0:
            return
        if self.skip_idle:
            self._t0 -= delay  # moving the origin back moves the run's clock forward
            self.idle_skipped_s += delay
        else:
            time.sleep(min(delay, 0.05))
