"""Step-cost models: how long one engine step takes, in closed form.

One linear family covers both forms the papers use and the profiles we fit::

    t = c0 + c_prefill·[P > 0] + a1·P + a2·A + b·D + d·KV + s·W

P  prefill tokens in the step,
A  Σ n_i·(past_i + n_i) over prefill chunks (attention work; N² for a whole prompt),
   or, for a model with an :class:`~duetime.core.attention_shape.AttentionShape`,
   the scores its kernels compute (sliding-window layers see fewer keys),
D  sequences decoding one token,
KV KV-cache tokens those decoders attend to,
W  tokens swapped in or out during the step.

Evicting part of a sequence's KV is not free either: ``e·N`` seconds for a
sequence holding N tokens when it is evicted (SnapKV scores every stored key
against its observation window, then gathers the kept ones), charged to the
step the eviction precedes. TimeBill's model has ``e = 0``; on our CPU engine
one SnapKV eviction costs about two decode steps (``duetime profile`` times it).

TimeBill (Eq. 5–6): prefill ``aN² + bN + c`` and decode ``p·N_kv + q`` are
``c0=q, c_prefill=c−q, a1=b, a2=a, d=p``. The batch form of Vidur and of the
Amin/Amax paper, ``c + a·P + b·D + d·KV``, sets the rest to zero.

The engine's kernels change with a step's row count (int8 kernels for a few
rows, bf16 matmuls for many): ``bands`` (:mod:`duetime.core.cost_bands`) add a
piecewise ``intercept + slope·rows`` on top, one piece per regime. Without bands
the model is the plain linear one.

Because the model is linear in KV (and the bands depend on the batch only), k
pure-decode steps of a fixed batch are an arithmetic series; :meth:`LinearStepCost.decode_span` and
:meth:`LinearStepCost.decode_steps_within` let the simulator jump over them.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeAlias

from duetime.core.attention_shape import AttentionShape, AttentionShapeError
from duetime.core.cost_bands import BandCost, CostBandError, bands_time, step_rows


def chunk_attention(rows: float, end: float, shape: AttentionShape | None = None) -> float:
    """A prompt chunk's term of ``A``: its ``rows`` computed tokens, the last at position
    ``end - 1``. Without ``shape``, each attends every key up to the chunk's end (the
    causal triangle within the chunk priced as the rectangle): ``rows·end``. With the
    model's :class:`~duetime.core.attention_shape.AttentionShape`, the scores its
    kernels compute. Every executor, the profile and the forecasts price a chunk with
    this one definition, so the fitted ``a2`` means the same wherever it is used."""
    return rows * end if shape is None else shape.work(rows, end)


class CostModelError(ValueError):
    """A cost model or profile file is invalid."""


_COEFFS = ("c0", "c_prefill", "a1", "a2", "b", "d", "s", "e")

#: Shortest decode step a cost model may give (one sequence, empty cache), in seconds.
#: A step of ~0 s leaves the clock where it was: ``c0 = 1e-320`` made the step count
#: of a decode run infinite (an OverflowError deep in the simulator).
MIN_STEP_S = 1e-9


@dataclass(slots=True, frozen=True)
class LinearStepCost:
    """The linear step-cost family above; coefficients in seconds per unit."""

    c0: float = 0.0
    c_prefill: float = 0.0
    a1: float = 0.0
    a2: float = 0.0
    b: float = 0.0
    d: float = 0.0
    s: float = 0.0
    e: float = 0.0
    bands: tuple[BandCost, ...] = ()
    #: The model's attention kernels, for the ``A`` term; None prices ``rows·end``.
    attention: AttentionShape | None = None
    name: str = "linear"
    meta: dict[str, Any] = field(default_factory=dict, compare=False)
    #: The bands' seconds per decode batch, filled as the simulator asks (its steps are
    #: priced at every event: the bands' loop cost it ~20 % of its time at 100k requests).
    _band_memo: dict[int, float] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        for k in _COEFFS:
            v = getattr(self, k)
            if not math.isfinite(v) or v < 0:
                raise CostModelError(f"cost coefficient {k} must be finite and >= 0, got {v}")
        if not all(isinstance(b, BandCost) for b in self.bands):
            raise CostModelError("bands must be BandCost objects")
        one = self.decode_step(1, 0)
        if not one >= MIN_STEP_S:
            raise CostModelError(
                f"a decode step must cost at least {MIN_STEP_S:g} s: need c0 + b (+ the "
                f"bands of one row) >= {MIN_STEP_S:g}, got {one:g}"
            )

    # --- constructors ---------------------------------------------------------
    @classmethod
    def timebill(cls, a: float, b: float, c: float, p: float, q: float) -> LinearStepCost:
        """TimeBill's ETE: prefill ``aN² + bN + c``, decode step ``p·N_kv + q``."""
        return cls(c0=q, c_prefill=max(c - q, 0.0), a1=b, a2=a, d=p, name="timebill")

    @classmethod
    def batch(cls, c: float, a: float, b: float, d: float) -> LinearStepCost:
        """Batch form: ``c + a·P + b·D + d·KV``."""
        return cls(c0=c, a1=a, b=b, d=d, name="batch")

    @classmethod
    def from_profile(cls, path: str | Path) -> LinearStepCost:
        """Read a profile JSON (``{"name", "coefficients": {...}, "source", ...}``)."""
        path = Path(path)
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise CostModelError(f"{path}: profile file not found") from None
        except UnicodeDecodeError:
            raise CostModelError(f"{path}: not a profile (not UTF-8 text)") from None
        except json.JSONDecodeError as e:
            raise CostModelError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(raw, str(path), path.stem)

    @classmethod
    def from_dict(cls, raw: Any, where: str, default_name: str = "profile") -> LinearStepCost:
        """A profile's JSON object (:meth:`to_profile`'s, a file's or a backend's
        ``/v1/profile``); ``where`` names it in a :class:`CostModelError`."""
        if not isinstance(raw, dict) or not isinstance(raw.get("coefficients"), dict):
            raise CostModelError(f"{where}: expected an object with a 'coefficients' object")
        coeffs = raw["coefficients"]
        unknown = set(coeffs) - set(_COEFFS)
        if unknown:
            raise CostModelError(f"{where}: unknown coefficient(s) {sorted(unknown)}")
        wrong = [
            k for k, v in coeffs.items() if isinstance(v, bool) or not isinstance(v, int | float)
        ]
        if wrong:  # float() read "0.01" and true as numbers
            raise CostModelError(f"{where}: coefficients must be numbers: {sorted(wrong)}")
        values = {k: float(coeffs.get(k, 0.0)) for k in _COEFFS}
        raw_bands = raw.get("bands") or []
        if not isinstance(raw_bands, list) or not all(isinstance(b, dict) for b in raw_bands):
            raise CostModelError(f"{where}: 'bands' must be a list of band objects")
        own = ("coefficients", "name", "bands", "attention")
        meta = {k: v for k, v in raw.items() if k not in own}
        try:
            bands = tuple(BandCost.from_dict(b) for b in raw_bands)
            attention = raw.get("attention")
            shape = None if attention is None else AttentionShape.from_dict(attention)
            return cls(
                **values, bands=bands, attention=shape, name=str(raw.get("name", default_name)),
                meta=meta,
            )  # fmt: skip
        except (CostModelError, CostBandError, AttentionShapeError) as e:
            raise CostModelError(f"{where}: {e}") from None

    def to_profile(self) -> dict[str, Any]:
        d = {k: getattr(self, k) for k in _COEFFS}
        meta = dict(self.meta)
        name = self.name
        out: dict[str, Any] = {"name": name, "coefficients": d}
        if self.bands:
            out["bands"] = [b.as_dict() for b in self.bands]
        if self.attention is not None:
            out["attention"] = self.attention.as_dict()
        return {**out, **meta}

    # --- costs ----------------------------------------------------------------
    def step_time(
        self,
        prefill_tokens: float,
        prefill_attn: float,
        decode_seqs: int,
        kv_tokens: int,
        swap_tokens: int = 0,
    ) -> float:
        t = self.c0 + self.a1 * prefill_tokens + self.a2 * prefill_attn
        t += self.b * decode_seqs + self.d * kv_tokens + self.s * swap_tokens
        if prefill_tokens > 0:
            t += self.c_prefill
            if self.bands:
                t += bands_time(self.bands, *step_rows(prefill_tokens, decode_seqs))
        elif self.bands:
            t += self._decode_bands(decode_seqs)
        return t

    def decode_step(self, decode_seqs: int, kv_tokens: float) -> float:
        """One pure-decode step of ``decode_seqs`` sequences attending ``kv_tokens``."""
        t = self.c0 + self.b * decode_seqs + self.d * kv_tokens
        return t + self._decode_bands(decode_seqs) if self.bands else t

    def _decode_bands(self, decode_seqs: int) -> float:
        """The bands' seconds for a pure-decode step of ``decode_seqs`` rows (memoised)."""
        band = self._band_memo.get(decode_seqs)
        if band is None:
            band = bands_time(self.bands, decode_seqs, decode_seqs)
            if len(self._band_memo) < 4096:  # a mean batch (a float) must not grow it forever
                self._band_memo[decode_seqs] = band
        return band

    def scaled(self, *, compute: float = 1.0, memory: float = 1.0) -> LinearStepCost:
        """This model on a machine ``compute``/``memory`` times as slow in the per-row and the
        fixed/KV terms (the bands are per-row kernel work: they scale with ``compute``)."""
        return replace(
            self,
            c0=self.c0 * memory,
            c_prefill=self.c_prefill * memory,
            d=self.d * memory,
            a1=self.a1 * compute,
            a2=self.a2 * compute,
            b=self.b * compute,
            bands=tuple(
                replace(b, intercept=b.intercept * compute, slope=b.slope * compute)
                for b in self.bands
            ),
        )

    def eviction_time(self, kv_tokens: int) -> float:
        """Seconds to evict part of a sequence that holds ``kv_tokens`` tokens of KV."""
        return self.e * kv_tokens

    def prefill_time(self, n: int) -> float:
        """One whole prompt of n tokens alone (TimeBill's t_prefill)."""
        return self.prompt_step(n)

    def prompt_step(self, n: float, decode_seqs: int = 0, kv_tokens: int = 0) -> float:
        """One step that prefills a whole prompt of ``n`` tokens (one chunk, no past)
        beside ``decode_seqs`` decoders attending ``kv_tokens``: the one place a whole
        prompt's ``A`` is counted, so every estimate prices it as the kernels run it."""
        return self.step_time(n, self.chunk_attention(n, n), decode_seqs, kv_tokens)

    def chunk_attention(self, rows: float, end: float) -> float:
        """A prompt chunk's ``prefill_attn`` under this model's :attr:`attention`."""
        return chunk_attention(rows, end, self.attention)

    def alone_time(self, prompt_tokens: int, output_tokens: int) -> float:
        """One request on an idle engine: its prompt's prefill, then ``output_tokens - 1``
        decode steps of one sequence (the prefill makes the first token)."""
        return self.prefill_time(prompt_tokens) + self.decode_span(
            max(0, output_tokens - 1), 1, prompt_tokens
        )

    def decode_span(self, k: int, decode_seqs: int, kv_tokens: int) -> float:
        # step i (0-based) attends kv_tokens + i·D tokens:
        # Σ_{i<k} (C + d·(KV + i·D)) = k·(C + d·KV) + d·D·k(k−1)/2
        base = self.decode_step(decode_seqs, kv_tokens)
        return k * base + self.d * decode_seqs * k * (k - 1) / 2.0

    def decode_steps_within(self, horizon: float, decode_seqs: int, kv_tokens: int) -> int:
        if horizon <= 0:
            return 0
        base = self.decode_step(decode_seqs, kv_tokens)
        g = self.d * decode_seqs  # growth of the step time per step
        if g <= 0:
            return int(horizon / base * (1 + 1e-12))
        # g/2·k² + (base − g/2)·k − horizon <= 0
        bq = base - g / 2.0
        k = int((-bq + math.sqrt(bq * bq + 2.0 * g * horizon)) / g)
        # guard against rounding either way
        while k > 0 and self.decode_span(k, decode_seqs, kv_tokens) > horizon * (1 + 1e-12):
            k -= 1
        while self.decode_span(k + 1, decode_seqs, kv_tokens) <= horizon * (1 + 1e-12):
            k += 1
        return k


#: What an executor, a policy and a forecast price steps with. One linear family
#: (with its bands) describes every profile we fit and both papers' forms, so the
#: name is that class, not a protocol restating its signatures.
CostModel: TypeAlias = LinearStepCost
