"""First-come first-served with vLLM's behaviour.

Admit in arrival order while the prompt fits in free KV memory (stopping at
the first that does not: head-of-line blocking); when the running batch needs
a KV slot that is not there, preempt the most recently admitted sequence
(recompute by default, ``preempt_mode="swap"`` for swapping).
"""

from __future__ import annotations

from duetime.policies.base import QueuePolicy
from duetime.policies.registry import register


@register("fcfs")
class FCFS(QueuePolicy):
    """vLLM-style FCFS: the baseline every other policy is compared with."""

    name = "fcfs"
