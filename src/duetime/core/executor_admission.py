"""Admission: requests arriving, and a policy's decision applied in its fixed order.

A decision is applied as cancel, preempt, suspend, resume, evict, then the
prefill chunks (a waiting sequence admitted with its prefix-cache hit), each
checked against the request's state: an illegal one raises
:class:`~duetime.core.policy.PolicyError`. :meth:`Admission._check_limits`
then holds the step to the batch and KV limits.
"""

from __future__ import annotations

from duetime.core.decision import Decision
from duetime.core.executor_state import ExecutorError
from duetime.core.executor_step import StepBooks
from duetime.core.policy import PolicyError
from duetime.core.record import RequestRecord
from duetime.core.request import Job
from duetime.core.sequence import Seq, SeqStatus


class Admission(StepBooks):
    """Arrivals, decisions and the step's limits."""

    def admit_arrival(self, job: Job) -> None:
        req = job.request
        if req.rid in self.seqs:
            raise ExecutorError(f"duplicate request id {req.rid}")
        if self.predictor is not None and req.predicted is None:
            req.predicted = self.predictor.predict_job(job)
        seq = Seq(req, self.clock, self._order)
        target = min(job.output_len, req.max_tokens)
        seq._segment_end = min(job.segments[0], target) if job.segments else target
        rec = RequestRecord(request=req, target_tokens=target)
        never_fits = req.prompt_len + 1 > self.kv_capacity
        if not never_fits:
            # Queued before it is registered: a policy's waiting key that raises (hsf with
            # no length prediction) must leave no trace, or a server that refuses the
            # request and goes on would hold it, unreachable and unfinished, for good.
            self.waiting.push(seq)
        self._order += 1
        self._jobs[req.rid] = job
        self.seqs[req.rid] = seq
        self.records[req.rid] = rec
        if never_fits:
            # Can never fit: refuse at once, as vLLM rejects prompts over max_model_len.
            seq.status = SeqStatus.CANCELLED
            rec.cancelled_at = self.now
            self.counters["rejected"] += 1
            self.n_done += 1

    def _get(self, rid: int, what: str) -> Seq:
        seq = self.seqs.get(rid)
        if seq is None:
            raise PolicyError(f"policy {self.policy.name!r}: {what} of unknown request {rid}")
        return seq

    def _apply_changes(self, dec: Decision) -> None:
        """Carry out a decision's cancels, preemptions, suspends, resumes and evictions."""
        name = self.policy.name
        for rid in dec.cancel:
            seq = self._get(rid, "cancel")
            if seq.status >= SeqStatus.FINISHED:
                raise PolicyError(f"policy {name!r}: cancel of {seq.status.name} request {rid}")
            self._cancel(seq)
        for rid in dec.preempt:
            seq = self._get(rid, "preempt")
            if seq.status not in (SeqStatus.RUNNING, SeqStatus.SUSPENDED):
                raise PolicyError(f"policy {name!r}: preempt of {seq.status.name} request {rid}")
            if dec.preempt_mode == "swap" and seq.kv_offloaded:
                continue  # suspended and already off the books: nothing to move
            kv = seq.kv_tokens
            self._release(seq)
            self.preemptions += 1
            seq.num_preemptions += 1
            if dec.preempt_mode == "swap" and seq.prefill_done:
                self._on_swap_out(seq)
                seq.status = SeqStatus.SUSPENDED
                seq.kv_offloaded = True
                self.suspended[rid] = seq
                self._pending_swap += kv
                self.counters["swaps"] += 1
            elif dec.preempt_mode == "restart":
                self._drop_kv(seq)
                self._restart(seq)
            else:  # recompute: recompute prompt + generated tokens later
                self._drop_kv(seq)
                seq.status = SeqStatus.WAITING
                seq.prefill_target = seq.req.prompt_len + seq.generated
                seq.prefilled = 0
                seq.kv_evicted = 0
                seq.kv_offloaded = False
                self.waiting.push(seq)
        for rid in dec.suspend:
            seq = self._get(rid, "suspend")
            if seq.status is not SeqStatus.RUNNING or not seq.prefill_done:
                raise PolicyError(f"policy {name!r}: suspend of non-decoding request {rid}")
            self._stop_decoding(seq)
            del self.running[rid]
            seq.status = SeqStatus.SUSPENDED
            self._park(seq)
            self.suspended[rid] = seq
        for rid in dec.resume:
            seq = self._get(rid, "resume")
            if seq.status is not SeqStatus.SUSPENDED:
                raise PolicyError(f"policy {name!r}: resume of {seq.status.name} request {rid}")
            del self.suspended[rid]
            if seq.rid in self._parked:
                self._unpark(seq)  # never paged out: the KV is still on the device
                seq.kv_offloaded = False
            elif seq.kv_offloaded:
                self._on_swap_in(seq)
                seq.kv_offloaded = False
                self._pending_swap += seq.kv_tokens
                self.counters["swap_ins"] = self.counters.get("swap_ins", 0) + 1
            else:
                self._static_kv -= seq.kv_tokens
            seq.status = SeqStatus.RUNNING
            self.running[rid] = seq
            self._start_decoding(seq)
        for rid, alpha in dec.evict.items():
            seq = self._get(rid, "evict")
            if not (0.0 <= alpha < 1.0):
                raise PolicyError(f"policy {name!r}: eviction ratio {alpha} not in [0, 1)")
            if seq.status not in (SeqStatus.RUNNING, SeqStatus.SUSPENDED) or not seq.prefill_done:
                raise PolicyError(f"policy {name!r}: evict on request {rid} without a full KV")
            n = int(alpha * seq.kv_tokens)
            self._chains.pop(rid, None)  # its later blocks would not be a full prefill's
            self._on_evict(seq, n, alpha)
            seq.kv_evicted += n
            if seq.decoding:
                self._rebase()
                self._dec_kv_base -= n
            elif seq.rid in self._parked:
                self._parked_kv -= n
            elif not seq.kv_offloaded:
                self._static_kv -= n
            self.records[rid].kv_evicted_ratio = alpha

    def _apply(self, dec: Decision) -> list[tuple[Seq, int]]:
        """Carry ``dec`` out in its fixed order; returns the step's prefill chunks."""
        if dec.cancel or dec.preempt or dec.suspend or dec.resume or dec.evict:
            self._apply_changes(dec)  # (most scheduling points change none of these)
        chunks: list[tuple[Seq, int]] = []
        if not dec.prefill:
            if self.borrowed:
                self.borrowed = {}
            return chunks
        name = self.policy.name
        named: set[int] = set()
        seqs = self.seqs
        cache = self.prefix_cache
        for rid, n in dec.prefill:
            seq = seqs.get(rid) or self._get(rid, "prefill")
            if rid in named:
                # Both chunks would start where the prefill stands: the same tokens twice
                # (the engine's cache would store them twice, the books count them twice).
                raise PolicyError(f"policy {name!r}: prefill of request {rid} twice in one step")
            named.add(rid)
            if seq.status is SeqStatus.WAITING:
                cached = self._on_admit(seq, [] if cache is None else self._prefix_hit(seq))
                if not 0 <= cached < seq.prefill_target:  # the step must compute a token
                    raise ExecutorError(
                        f"request {rid}: {cached} cached tokens of a {seq.prefill_target}-token "
                        "prefill (a hit must leave at least one token to compute)"
                    )
                self.waiting.remove(seq)
                seq.status = SeqStatus.RUNNING
                self.running[rid] = seq
                self.prefilling[rid] = seq
                if cached:
                    seq.prefilled = cached
                    self._static_kv += cached
                    self.prefill_cached_tokens += cached
                self.records[rid].cached_prompt_tokens = min(cached, seq.req.prompt_len)
            elif seq.status is not SeqStatus.RUNNING or seq.prefilled >= seq.prefill_target:
                raise PolicyError(f"policy {name!r}: prefill of request {rid} in {seq!r}")
            left = seq.prefill_target - seq.prefilled
            chunks.append((seq, left if n <= 0 or n > left else n))
        self._share_prefills(chunks)
        return chunks

    def _check_limits(self, chunks: list[tuple[Seq, int]], prefill_only: bool = False) -> None:
        name = self.policy.name
        if prefill_only and not chunks:
            raise PolicyError(f"policy {name!r}: a prefill-only step without a prefill")
        p_tokens = 0
        for _, n in chunks:
            p_tokens += n
        n_dec = 0 if prefill_only else self._n_dec
        if p_tokens + n_dec > self.max_batch_tokens:
            raise PolicyError(
                f"policy {name!r}: step has {p_tokens} prefill + {n_dec} decode tokens, "
                f"over max_batch_tokens={self.max_batch_tokens}"
            )
        if len(self.running) > self.max_num_seqs:
            raise PolicyError(
                f"policy {name!r}: {len(self.running)} running sequences, "
                f"over max_num_seqs={self.max_num_seqs}"
            )
        kv_used = (
            self._static_kv + self._dec_kv_base + self._n_dec * (self.clock.steps - self._dec_mark)
        )
        need = kv_used + p_tokens + n_dec
        if need > self.kv_capacity:
            raise PolicyError(
                f"policy {name!r}: next step needs {need} KV tokens, "
                f"capacity is {self.kv_capacity} (at t={self.now:.3f}s)"
            )
        if self._parked:
            self._page_out(need)
