"""LRTrace-style robot workloads (TimelyLLM §6, Tables 2–3), generated, seeded.

Source: ``../shared/seeds/timelyllm.txt``. The paper records real traces
from a Tello drone and an Indy7 arm; those traces are not public, so this
module rebuilds the *structure* the paper describes:

- events arrive as a Poisson process with ``eps`` events per second over
  ``time_s`` seconds; each event triggers ``U{1..max_tpe}`` tasks at once,
  each picked uniformly from the workload's trace ids (Table 3);
- each trace id (Table 2) is a plan: a list of robot skills. A skill is one
  segment (the executable statement the stop checker cuts at) with a token
  length and an execution time from a time model in the paper's spirit
  (distance / angle driven for moves and turns, sampled for searches, near
  zero for ``print``). Drone plans are ~20 tokens, arm plans ~100 (§6);
- ``segment_gaps[k]`` is the robot's execution time of segment ``k``: the
  client wants segment ``k + 1`` when that action ends;
  ``segment_gap_estimates[k]`` is what the server's time model says (§4.3):
  the same for actions whose time follows from the command (a move's distance,
  a turn's angle, an arm skill), the *minimum* for a search, whose time
  depends on where the target is (``SEARCH_MIN_S``, "to ensure the plan can be
  generated in time, even in the worst case");
- TUFs (§2.3, §7.1): normal drone and arm tasks ERT 1 s, β 1, α −2; urgent
  drone tasks ERT 0.2 s, β 2, α −6.67 (our copy's text reads "α at 6.67",
  its LaTeX ``-6.67``, and the 0.5 s cut-off it gives agrees); chatbot like
  normal;
- chatbot tasks (§7.4.2, optional ``chatbot_share``): sentence segments of
  15–35 tokens, the gap is reading time at 300 words per minute with
  words ≈ 0.75 × tokens, i.e. 0.15 s per token;
- prompts: only the part that varies per task (the skill set, guidance and
  examples are stored on the server and cached, §4.1), 200–500 tokens for a
  robot task, 30–119 for a chatbot one.

``Request.klass`` is the task category ("normal", "urgent", "arm",
"chatbot"); ``deadline = arrival + ERT`` so deadline policies (EDF) see the
same urgency. ``AN`` (agent number) is kept in the settings for reference; we
do not serialise tasks per agent.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from duetime.core.request import Job, Request, TimeUtility

TUF_NORMAL = TimeUtility(ert=1.0, beta=1.0, alpha=-2.0)
TUF_URGENT = TimeUtility(ert=0.2, beta=2.0, alpha=-2.0 / 0.3)  # cut-off 0.5 s: α ≈ −6.67
TUF_CHATBOT = TimeUtility(ert=1.0, beta=1.0, alpha=-2.0)
READ_S_PER_TOKEN = 0.75 / 300.0 * 60.0  # 300 words/min, 0.75 words per token = 0.15 s


@dataclass(frozen=True, slots=True)
class LRTraceSettings:
    """One row of TimelyLLM Table 3."""

    wid: int
    eps: float  # events per second (Poisson rate)
    max_tpe: int  # maximum tasks per event
    trace_ids: tuple[int, ...]
    agents: int  # AN
    time_s: float


WORKLOADS: dict[int, LRTraceSettings] = {
    1: LRTraceSettings(1, 0.25, 8, tuple(range(1, 9)), 25, 260.0),
    2: LRTraceSettings(2, 0.25, 16, tuple(range(1, 9)), 42, 300.0),
    3: LRTraceSettings(3, 0.1, 8, (9, 10, 11), 40, 900.0),
}

Rng = np.random.Generator
Skill = Callable[[Rng], tuple[int, float]]  # -> (tokens, execution seconds)


def _move(rng: Rng) -> tuple[int, float]:  # mf(50): 30–100 cm at ~0.4 m/s + settle
    return int(rng.integers(4, 7)), 0.5 + float(rng.uniform(30, 100)) / 40.0


def _turn(rng: Rng) -> tuple[int, float]:  # tc(90): 30–180 degrees at ~90°/s
    return int(rng.integers(4, 7)), 0.3 + float(rng.uniform(30, 180)) / 90.0


SEARCH_MIN_S = 2.0


def _search(rng: Rng) -> tuple[int, float]:  # s('cat'): scenario-dependent, sampled
    return int(rng.integers(5, 8)), float(rng.uniform(SEARCH_MIN_S, 6.0))


def _check(rng: Rng) -> tuple[int, float]:  # ?iv('book')==True: one detector call
    return int(rng.integers(6, 9)), 0.2


def _print(rng: Rng) -> tuple[int, float]:  # p('found'): ~1 ms (the paper's task type 1)
    return int(rng.integers(3, 6)), 0.001


def _arm(lo: float, hi: float) -> Skill:
    def skill(rng: Rng) -> tuple[int, float]:  # pick(red_box) / place(...) / move_to(...)
        return int(rng.integers(9, 14)), float(rng.uniform(lo, hi))

    return skill


_PICK, _PLACE, _REACH = _arm(2.5, 3.5), _arm(2.0, 3.0), _arm(1.0, 2.0)

# Table 2: trace id -> (category, plan)
TRACES: dict[int, tuple[str, tuple[Skill, ...]]] = {
    1: ("normal", (_search, _check, _turn, _move, _print)),  # look for the cat
    2: ("normal", (_search, _search, _check, _print)),  # keys or wallets
    3: ("normal", (_turn, _move, _check, _print)),  # book on the cabinet
    4: ("normal", (_search, _move, _check, _print)),  # toy under the bed
    5: ("normal", (_search, _check, _move, _print)),  # tool for cutting paper
    6: ("urgent", (_move, _turn)),  # avoiding human injury
    7: ("urgent", (_turn, _move)),  # preventing potential collision
    8: ("urgent", (_move, _turn, _move)),  # evading animal pursuit
    9: ("arm", (_REACH, _PICK, _PLACE) * 3),  # object stacking
    10: ("arm", (_PICK, _PLACE) * 4 + (_REACH,)),  # desk cleaning
    11: ("arm", (_PICK, _PLACE) * 4),  # fruit and vegetable classification
}
_TUF = {"normal": TUF_NORMAL, "urgent": TUF_URGENT, "arm": TUF_NORMAL, "chatbot": TUF_CHATBOT}
# The server's time model gives these skills' minimum; every other skill's time is known.
_ESTIMATE_S: dict[Skill, float] = {_search: SEARCH_MIN_S}


def _plan(trace_id: int, rng: Rng) -> tuple[str, list[int], list[float], list[float]]:
    klass, skills = TRACES[trace_id]
    toks, times = zip(*(s(rng) for s in skills), strict=True)
    estimates = [_ESTIMATE_S.get(s, t) for s, t in zip(skills, times, strict=True)]
    return klass, list(toks), list(times), estimates


def _chatbot(rng: Rng) -> tuple[str, list[int], list[float], list[float]]:
    toks = [int(t) for t in rng.integers(15, 36, size=int(rng.integers(6, 13)))]
    times = [t * READ_S_PER_TOKEN for t in toks]
    return "chatbot", toks, times, times


def lrtrace_jobs(
    wid: int | LRTraceSettings = 1,
    *,
    seed: int = 0,
    chatbot_share: float = 0.0,
    time_s: float | None = None,
) -> list[Job]:
    """Jobs of one LRTrace workload (Table 3 row ``wid``), arrival-ordered, rids from 0."""
    cfg = WORKLOADS[wid] if isinstance(wid, int) else wid
    horizon = cfg.time_s if time_s is None else time_s
    rng = np.random.default_rng([seed, cfg.wid])
    jobs: list[Job] = []
    t = float(rng.exponential(1.0 / cfg.eps))
    while t < horizon:
        for _ in range(int(rng.integers(1, cfg.max_tpe + 1))):
            if chatbot_share > 0 and rng.random() < chatbot_share:
                klass, toks, times, estimates = _chatbot(rng)
                prompt = int(rng.integers(30, 120))
            else:
                klass, toks, times, estimates = _plan(int(rng.choice(cfg.trace_ids)), rng)
                prompt = int(rng.integers(200, 501))
            tuf = _TUF[klass]
            req = Request(
                rid=len(jobs),
                arrival=t,
                prompt_len=prompt,
                max_tokens=4096,
                deadline=t + tuf.ert,
                tuf=tuf,
                klass=klass,
            )
            gaps, expected = tuple(times[:-1]), tuple(estimates[:-1])
            known = expected == gaps  # no search in the plan: the server knows every gap
            jobs.append(Job(req, sum(toks), tuple(toks), gaps, () if known else expected))
        t += float(rng.exponential(1.0 / cfg.eps))
    return jobs
