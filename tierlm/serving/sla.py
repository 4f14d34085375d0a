"""SLA guard: refuse up front a request its tier's time-to-first-token target cannot be met for.

Why: past capacity, a queue only grows; every request admitted then waits longer than the one
before, and requests served after their target are work done for nothing that also delays the
requests behind them. A tier may set `ttft_target_ms` in the tenants file; a request of that
tier is checked just before it reaches the engine, against the engine's own estimate of its
wait (engine/load.py: a step-time model fitted to the steps it ran, and the prompt tokens ahead
of it at its priority or better). Past the target it is refused at once with the API's overload
error (Anthropic 529 `overloaded_error`, OpenAI 503), with a `retry-after` of the time the
estimate says the queue needs to drain to the target. Both official SDKs retry these by default,
after that wait.

Lower tiers are shed first without a rule of their own: a request waits behind the work of its
priority and better only, so as load rises a bronze request's estimate passes its target before
a gold one's does. A tier without a target is never shed. Not yet: a breaker on measured
latencies, and falling back to a smaller model.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from tierlm.serving.auth import RequestContext
from tierlm.serving.errors import Overloaded


UNKNOWN_WAIT_S = 30  # retry-after when better tiers take the whole engine: no drain time to tell
MAX_WAIT_S = 600


class SlaShed(Overloaded):
    """A request refused because it would miss its tier's time-to-first-token target."""

    default_code = "sla_overloaded"


def check_ttft_target(engine: Any, model: str, ctx: RequestContext, prompt_tokens: int,
                      on_shed: Callable[[str, str], None] | None = None) -> float | None:
    """Raise SlaShed if `engine` estimates `ctx`'s request would wait past its tier's target;
    returns the estimate (None: no target, or nothing measured yet)."""
    target = ctx.ttft_target_s
    if target is None:
        return None
    estimate = engine.engine.estimate_ttft(prompt_tokens, ctx.priority)
    if estimate is None or estimate <= target:
        return estimate
    if on_shed is not None:
        on_shed(model, ctx.tier or "")
    if math.isinf(estimate):  # better tiers' arrivals take all of the engine
        wait, why = UNKNOWN_WAIT_S, "requests of better tiers are taking all of its capacity"
    else:
        wait, why = min(MAX_WAIT_S, max(1, math.ceil(estimate - target))), f"estimated wait {estimate:.1f} s"
    raise SlaShed(f"model '{model}' is too busy to start this request within tier '{ctx.tier}''s time-to-first-"
                  f"token target of {target:g} s ({why}); retry in {wait} s",
                  headers={"retry-after": str(wait), "retry-after-ms": str(wait * 1000)})
