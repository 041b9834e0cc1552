"""Workloads: who asks for what, and when.

- :mod:`.sharegpt`: ShareGPT pair lengths, recovered from the truncated bundled file, cached.
- :mod:`.sources`: length sources (ShareGPT, synthetic) and the caps they honour.
- :mod:`.arrivals`: Poisson, gamma, bursts, trace and all-at-once arrival processes.
- :mod:`.builder`: ``build_jobs`` ties the three together, with optional deadlines.
- :mod:`.lrtrace`: TimelyLLM's LRTrace robot workloads (WID1–WID3), segmented, with TUFs.
- :mod:`.trace`: JSONL trace files, written atomically, read with line-exact errors.
"""

from duetime.workloads.arrivals import (
    ARRIVALS,
    AllAtOnce,
    ArrivalProcess,
    Bursts,
    Gamma,
    Poisson,
    TraceArrivals,
    arrival_process,
)
from duetime.workloads.builder import Deadlines, SharedPrefix, build_jobs
from duetime.workloads.lrtrace import WORKLOADS as LRTRACE_WORKLOADS
from duetime.workloads.lrtrace import LRTraceSettings, lrtrace_jobs
from duetime.workloads.sharegpt import (
    ShareGPTLengths,
    ShareGPTStats,
    load_sharegpt_lengths,
    read_pairs,
)
from duetime.workloads.sources import (
    LengthCaps,
    LengthSample,
    LengthSource,
    ShareGPTPrompt,
    ShareGPTSource,
    SyntheticSource,
    load_sharegpt_prompts,
)
from duetime.workloads.trace import (
    TraceError,
    read_trace,
    trace_lines,
    write_trace,
    write_trace_lines,
)

__all__ = [
    "ARRIVALS",
    "LRTRACE_WORKLOADS",
    "AllAtOnce",
    "ArrivalProcess",
    "Bursts",
    "Deadlines",
    "Gamma",
    "LRTraceSettings",
    "LengthCaps",
    "LengthSample",
    "LengthSource",
    "Poisson",
    "ShareGPTLengths",
    "ShareGPTPrompt",
    "ShareGPTSource",
    "ShareGPTStats",
    "SharedPrefix",
    "SyntheticSource",
    "TraceArrivals",
    "TraceError",
    "arrival_process",
    "build_jobs",
    "load_sharegpt_lengths",
    "load_sharegpt_prompts",
    "lrtrace_jobs",
    "read_pairs",
    "read_trace",
    "trace_lines",
    "write_trace",
    "write_trace_lines",
]
