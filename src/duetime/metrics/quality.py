"""Response-quality scores between two token-id sequences: token F1 and ROUGE-L.

TimeBill (arXiv 2512.21859, Sec. 6.1) scores LongBench answers with the
benchmark's F1 and ROUGE-L. LongBench is not available offline, so duetime
scores an evicted run's greedy output against the full-KV greedy output of the
same prompt (the reference), on token ids rather than words: the question
asked is "how much did eviction change the answer", not "is the answer right".

* :func:`token_f1` — SQuAD / LongBench ``qa_f1_score``: precision and recall of
  the multiset of tokens (order ignored), ``F1 = 2PR / (P + R)``.
* :func:`rouge_l` — Lin (2004): ``LCS`` = the longest common subsequence,
  ``P = LCS/|candidate|``, ``R = LCS/|reference|``, F-measure with β = 1 (what
  ``rouge-score`` and LongBench report as ROUGE-L F).

Both are 1.0 for identical sequences (two empty ones included) and 0.0 when
exactly one is empty or they share no token.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence


def _f_measure(overlap: int, n_cand: int, n_ref: int) -> float:
    if overlap == 0:
        return 0.0
    p, r = overlap / n_cand, overlap / n_ref
    return 2.0 * p * r / (p + r)


def token_f1(candidate: Sequence[int], reference: Sequence[int]) -> float:
    """Bag-of-tokens F1 of ``candidate`` against ``reference``."""
    if not candidate and not reference:
        return 1.0
    overlap = sum((Counter(candidate) & Counter(reference)).values())
    return _f_measure(overlap, len(candidate), len(reference))


def lcs_length(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common subsequence, O(|a|·|b|) time, O(|b|) memory."""
    if not a or not b:
        return 0
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


def rouge_l(candidate: Sequence[int], reference: Sequence[int]) -> float:
    """ROUGE-L F-measure (β = 1) of ``candidate`` against ``reference``."""
    if not candidate and not reference:
        return 1.0
    return _f_measure(lcs_length(candidate, reference), len(candidate), len(reference))
