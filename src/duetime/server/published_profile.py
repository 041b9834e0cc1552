"""``GET /v1/profile``: the server's step-cost model, as the profile JSON `duetime profile` writes.

A gateway (or a person) in front of a fleet needs each backend's cost model to
forecast it; `duetime serve` already keeps one, the online fit of its own steps
(:class:`~duetime.server.step_timer.StepTimer`), so it publishes that instead of
asking for a separate black-box run (`duetime profile --url`). The body is a
profile: ``LinearStepCost.from_profile`` and ``duetime sim --profile`` read it as
written, with the engine's limits (``kv_capacity_tokens``, ``max_num_seqs``,
``max_batch_tokens``) and where the model came from (``origin``).

Before any model exists (no profile given, none measured at start, too few steps
served yet) the answer is 503 with the reason and ``Retry-After``: a client that
scripts ``curl .../v1/profile > p.json`` must not get a file that is no profile.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from duetime.server.server_state import ServerState

__all__ = ["published_profile"]


def published_profile(state: ServerState) -> dict[str, Any] | None:
    """The profile body of ``GET /v1/profile`` (None: no model yet).

    ``origin.kind`` is ``"online fit"`` (``steps``: the served steps it was fitted to),
    ``"measured at start"`` or ``"given profile PATH"`` (``steps`` 0): a model fitted to
    this server's own recent steps deserves more trust than one measured elsewhere.
    """
    timer = state.engine.timer
    cost = timer.as_cost()
    if cost is None:
        return None
    kind, steps = timer.origin()
    ex = state.engine.executor
    name = state.config.model_name
    what = f"online fit over {steps} served steps" if steps else str(kind)
    body = cost.to_profile()
    body["name"] = f"{name}-served"
    body.update(
        {
            "kv_capacity_tokens": int(ex.kv_capacity),
            "max_num_seqs": int(ex.max_num_seqs),
            "max_batch_tokens": int(ex.max_batch_tokens),
            "source": f"published by `duetime serve` ({name}): {what}",
            "origin": {"kind": kind, "steps": steps},
            "served_model": name,
            **({"engine": state.config.engine} if state.config.engine else {}),
            "units": "seconds per unit; t = c0 + c_prefill*[P>0] + a1*P + a2*A + b*D + d*KV "
            "+ per band on its axis (rows = P + D, head_rows = D + [P>0]): "
            "intercept + slope*rows",
        }
    )
    return body
