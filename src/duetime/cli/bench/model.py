"""The one engine-model loader of the `duetime bench ... --engine` modes.

The engine modes differ only in what they accept (a clock, a GGUF path), which
each mode checks before calling this. :class:`EngineChoice` is the model / dtype /
threads / clock quadruple that `amin` and `deferred-prefill` resolve, label
and load the same way.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from duetime.cli.bench.options import no_engine_options


def load_engine(spec: str, dtype: str, threads: int, clock: str | None = None) -> Any:
    """``gemma``, ``tiny`` (random weights) or a GGUF path, on ``threads`` torch threads.

    ``clock``: checked against ``threads`` first, so a bad one fails before the
    (slow) load rather than after.
    """
    import torch

    from duetime.bench.engine_fit import bench_clock, load_bench_model

    if clock is not None:
        bench_clock(clock, threads)
    torch.set_num_threads(threads)
    return load_bench_model(spec, dtype)


@dataclass(frozen=True)
class EngineChoice:
    """The engine a `--engine` run loads, from the shared `Engine*Opt` options."""

    model: str = "gemma"
    dtype: str = "fp32"
    threads: int = 1
    clock: str = "cpu"

    @classmethod
    def from_options(
        cls, model: str | None, dtype: str | None, threads: int | None, clock: str | None
    ) -> EngineChoice:
        """Unset options take the defaults above (those the options' help texts quote)."""
        d = cls()
        return cls(model or d.model, dtype or d.dtype, threads or d.threads, clock or d.clock)

    @classmethod
    def if_engine(
        cls,
        engine: bool,
        model: str | None,
        dtype: str | None,
        threads: int | None,
        clock: str | None,
        others: Mapping[str, object],
    ) -> EngineChoice | None:
        """With ``--engine``, the engine of these options (:meth:`from_options`); without
        it ``None``, once no engine-only option was given: these four and ``others``
        (named as on the command line), which a run without the engine would ignore."""
        if engine:
            return cls.from_options(model, dtype, threads, clock)
        given = {"--model": model, "--dtype": dtype, "--threads": threads, "--clock": clock}
        no_engine_options({**given, **others})
        return None

    @property
    def label(self) -> str:
        """How reports and figures name this engine."""
        return f"{self.model}, {self.dtype}, {self.threads} thread(s), {self.clock} clock"

    def load(self) -> Any:
        """The model, with the clock checked first (see :func:`load_engine`)."""
        return load_engine(self.model, self.dtype, self.threads, self.clock)

    def run_bench(
        self, bench: Any, *, checks: Mapping[str, Any], profile: str | None, **run: Any
    ) -> dict[str, Any]:
        """An engine bench module's ``run`` on this engine, after the checks every
        ``--engine`` paper bench makes before the model loads, so a typo costs no load:
        the dtype, the clock, ``bench.check_options(**checks)`` against the model's
        context (read from its config, not its weights) and the profile, if named (timed
        on this dtype and thread count: :func:`check_profile_engine`)."""
        from duetime.bench.engine_fit import bench_clock, check_dtype, engine_context, read_profile

        check_dtype(self.dtype)
        bench_clock(self.clock, self.threads)
        bench.check_options(**checks, context=engine_context(self.model))
        if profile is not None:
            from duetime.predict.cost_report import check_profile_engine

            cost, _ = read_profile(profile)
            check_profile_engine(cost.meta, profile, self.dtype, self.threads)
        fig: dict[str, Any] = bench.run(
            self.load(), model_name=self.label, clock=self.clock, profile=profile, **run
        )
        return fig


def step_cost_note(fit: Mapping[str, Any]) -> str:
    """``step costs: <source>[, fit MAPE x %]``: where a run's step-cost model came from."""
    fitted = f", fit MAPE {fit['fit_mape_pct']:.1f} %" if "fit_mape_pct" in fit else ""
    return f"step costs: {fit['source']}{fitted}"


def load_prompted_model(spec: str, dtype: str, seed: int, vocab_size: int | None = None) -> Any:
    """The model of the engine commands that make their own prompts (`prefix-cache`,
    `shared-prefill`, `grammar`, `eviction`): ``tiny`` with random weights seeded by
    ``seed`` (as their random prompts are; a vocabulary of ``vocab_size`` where given),
    else ``gemma`` or a GGUF path, loaded with its progress bar. Unlike
    :func:`load_engine`, torch's threads are the caller's to set."""
    if spec == "tiny":
        from duetime.engine.testing import engine_from_hf, tiny_hf_model

        sizes = {} if vocab_size is None else {"vocab_size": vocab_size}
        return engine_from_hf(tiny_hf_model(seed=seed, **sizes), dtype)  # type: ignore[arg-type]
    from duetime.engine.load import load_model

    return load_model(None if spec == "gemma" else spec, dtype=dtype)  # type: ignore[arg-type]


def questions_after(
    spec: str, vocab: int, n: int, longest: int, seed: int, rng: random.Random
) -> list[list[int]]:
    """``n`` short prompts that follow a shared beginning (`prefix-cache`,
    `shared-prefill`): on ``tiny``, 1 to ``longest`` ids drawn from ``rng``; else
    ShareGPT prompts of 2 to ``longest + 1`` tokens with their BOS dropped."""
    if spec == "tiny":
        return [[rng.randrange(vocab) for _ in range(rng.randint(1, longest))] for _ in range(n)]
    from duetime.bench.eviction import sharegpt_prompts

    return [q[1:] for q in sharegpt_prompts(n, 2, longest + 1, seed)]


def shared_prompts(
    spec: str, vocab: int, lengths: Sequence[int], longest: int, seed: int, rng: random.Random
) -> list[list[int]]:
    """The long prompts many requests begin with (`prefix-cache`'s system prompt,
    `shared-prefill`'s copied and system ones), one of each of ``lengths`` tokens: on
    ``tiny``, ids drawn from ``rng`` in that order; else ShareGPT prompts of
    ``max(lengths)`` to ``longest`` tokens, each cut to its length."""
    if spec == "tiny":
        return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
    from duetime.bench.eviction import sharegpt_prompts

    drawn = sharegpt_prompts(len(lengths), max(lengths), longest, seed)
    return [p[:n] for p, n in zip(drawn, lengths, strict=True)]


def load_with_shared_prompts(
    spec: str,
    dtype: str,
    threads: int,
    seed: int,
    lengths: Sequence[int],
    longest: int,
    requests: int,
    question_len: int,
) -> tuple[Any, list[list[int]], list[list[int]]]:
    """The model and prompts of the benches whose requests share a beginning
    (`prefix-cache`, `shared-prefill`): the model on ``threads`` torch threads, the
    :func:`shared_prompts` of ``lengths`` (at most ``longest`` drawn) and ``requests``
    questions of at most ``question_len`` tokens after them (:func:`questions_after`),
    all seeded by ``seed``."""
    import torch

    torch.set_num_threads(threads)
    model = load_prompted_model(spec, dtype, seed)
    rng = random.Random(seed)
    vocab = model.config.vocab_size
    shared = shared_prompts(spec, vocab, lengths, longest, seed, rng)
    return model, shared, questions_after(spec, vocab, requests, question_len, seed, rng)


def check_questions_fit(system_len: int, question_len: int, new_tokens: int, context: int) -> None:
    """The longest request behind a shared prompt (`prefix-cache`, `shared-prefill`) must
    fit the model's ``context``; the error names the three options that add up."""
    from duetime.bench.engine_fit import check_context

    check_context(
        system_len + question_len + new_tokens,
        context,
        f"--system-len {system_len} + --question-len {question_len} + --new-tokens {new_tokens}",
    )
