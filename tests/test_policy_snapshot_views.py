"""What a policy reads of the snapshot's queues: the waiting queue takes an index or a
slice, the running, prefilling and suspended views iterate in admission order."""

from __future__ import annotations

from typing import Any

from duetime.core.cost import LinearStepCost
from duetime.core.request import Job, Request
from duetime.core.snapshot import EngineSnapshot
from duetime.policies.fcfs import FCFS
from duetime.sim import SimConfig, simulate


class _Peek(FCFS):
    """FCFS that records what slicing and iterating the snapshot's queues give."""

    name = "peek"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[tuple[list[int], list[int], int | None, list[int]]] = []

    def schedule(self, snap: EngineSnapshot) -> Any:
        waiting = list(snap.waiting)
        head = [s.rid for s in snap.waiting[:2]]
        assert head == [s.rid for s in waiting[:2]]
        assert [s.rid for s in snap.waiting[1:]] == [s.rid for s in waiting[1:]]
        last = snap.waiting[-1].rid if waiting else None
        self.seen.append((head, [s.rid for s in snap.running], last, [s.rid for s in waiting]))
        return super().schedule(snap)


def test_a_policy_slices_the_waiting_queue_and_iterates_the_running_one() -> None:
    jobs = [Job(Request(rid=i, arrival=0.0, prompt_len=8, max_tokens=4), 4) for i in range(6)]
    policy = _Peek()
    config = SimConfig(kv_capacity=10_000, max_num_seqs=2, max_batch_tokens=64)
    simulate(jobs, policy, LinearStepCost(c0=1.0), config)
    first_head, _, first_last, first_all = policy.seen[0]
    assert first_head == [0, 1]  # a slice: sequences, in queue order
    assert first_last == 5
    assert first_all == list(range(6))
    # once two run, the running view iterates them in admission order
    assert ([2, 3], [0, 1]) in [(head, running) for head, running, _, _ in policy.seen]


def test_no_public_field_of_a_waiting_sequence_holds_its_true_length() -> None:
    # `segment_end` held it: the stop the executor plans from the job's hidden truth
    jobs = [
        Job(Request(rid=i, arrival=0.0, prompt_len=50 + i, max_tokens=100), 3 + i) for i in range(6)
    ]
    seen: dict[int, set[object]] = {}

    class _Look(FCFS):
        name = "look"

        def schedule(self, snap: EngineSnapshot) -> Any:
            for seq in snap.waiting:
                public = [n for n in type(seq).__slots__ if not n.startswith("_")]
                values = (getattr(seq, n) for n in public)
                seen.setdefault(seq.rid, {v for v in values if isinstance(v, int | float)})
            return super().schedule(snap)

    config = SimConfig(kv_capacity=10_000, max_num_seqs=1, max_batch_tokens=256)
    simulate(jobs, _Look(), LinearStepCost(c0=1.0), config)
    assert sorted(seen) == list(range(6))
    assert all(job.output_len not in seen[job.request.rid] for job in jobs)
