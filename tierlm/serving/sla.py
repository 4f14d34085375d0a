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
a gold one's does. A tier without a target is never shed.

Two more guards, both in `SlaGuard`: a circuit breaker per (model, tier) on measured outcomes
(breaker.py: what the estimate got wrong), checked before the estimate; and a fallback model
(`--fallback-model BIG=SMALL`): a request the guard refuses for BIG is rendered again for SMALL
and served there if SMALL's guard admits it (its answer names SMALL as its model, and the
response carries `x-tierlm-fallback-from: BIG`), rather than refused.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Mapping, TypeVar

from starlette.responses import Response

from tierlm.serving.auth import RequestContext
from tierlm.serving.breaker import Breaker, BreakerOpen, BreakerSettings, Outcome
from tierlm.serving.errors import APIError, ClientDisconnected, Overloaded

logger = logging.getLogger("tierlm.serving")

UNKNOWN_WAIT_S = 30  # retry-after when better tiers take the whole engine: no drain time to tell
MAX_WAIT_S = 600
FALLBACK_HEADER = "x-tierlm-fallback-from"
TRIP_DISTRUST = 2.0  # each time a breaker opens, its tier's estimate is taken as this much too short
T = TypeVar("T")
R = TypeVar("R", bound=Response)


class SlaShed(Overloaded):
    """A request refused because it would miss its tier's time-to-first-token target."""

    default_code = "sla_overloaded"

    def __init__(self, message: str, *, model: str, tier: str, reason: str, retry_after: int) -> None:
        super().__init__(message, headers={"retry-after": str(retry_after), "retry-after-ms": str(retry_after * 1000)})
        self.model, self.tier, self.reason = model, tier, reason  # reason: "estimate" or "breaker"


def check_ttft_target(engine: Any, model: str, ctx: RequestContext, prompt_tokens: int) -> float | None:
    """Raise SlaShed if `engine` estimates `ctx`'s request would wait past its tier's target;
    returns the estimate (None: no target, or nothing measured yet).

    An idle engine (nothing running or waiting) sheds nothing on its estimate: there it frees
    nothing for anyone, and what it lets in is how the estimate learns again. After a slowdown,
    a tier whose only traffic was shed was shed for good: its step-time fit and factor learn
    only from requests that run, and none did."""
    target = ctx.ttft_target_s
    if target is None:
        return None
    estimate = engine.engine.estimate_ttft(prompt_tokens, ctx.priority)
    if estimate is None or estimate <= target or not engine.engine.has_unfinished():
        return estimate
    if math.isinf(estimate):  # better tiers' arrivals take all of the engine
        wait, why = UNKNOWN_WAIT_S, "requests of better tiers are taking all of its capacity"
    else:
        wait, why = min(MAX_WAIT_S, max(1, math.ceil(estimate - target))), f"estimated wait {estimate:.1f} s"
    raise SlaShed(f"model '{model}' is too busy to start this request within tier '{ctx.tier}''s time-to-first-"
                  f"token target of {target:g} s ({why}); retry in {wait} s",
                  model=model, tier=ctx.tier or "", reason="estimate", retry_after=wait)


@dataclass
class Admission:
    """A request the guard let through: it reports how it did to its breaker and its estimate."""

    guard: "SlaGuard"
    engine: Any
    model: str
    tier: str
    priority: int
    target_s: float
    estimate: float | None
    outcome: Outcome | None
    _timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """The engine has the request: a miss is known the moment its target passes without a
        first token (the breaker learns during a burst, not after it)."""
        if self.outcome is not None:
            self._timer = asyncio.get_running_loop().call_later(self.target_s, self._report, False)

    def first_token(self, ttft_s: float | None) -> None:
        """The first token came `ttft_s` after arrival (None: the request ended without one):
        the tier's breaker and the estimate it was admitted on both learn how it went."""
        self._report(None if ttft_s is None else ttft_s <= self.target_s)
        if self.estimate is not None and ttft_s is not None:  # (engine/load.py's TtftCalibration)
            self.engine.engine.observe_ttft(self.priority, self.estimate, ttft_s)

    def failed(self, exc: BaseException) -> None:
        """No first token: an engine failure (5xx) is a miss; a client's leaving or error is no verdict."""
        self._report(False if isinstance(exc, APIError) and exc.status >= 500 else None)

    def _report(self, met: bool | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.outcome is not None:
            self.guard._report(self, met)


@dataclass
class SlaGuard:
    """The SLA guard's state across requests: a breaker per (model, tier) and the fallbacks.

    `fallbacks`: model → the model that serves what the guard refuses it. `breaker`: the
    breakers' settings (None: no breaker). `on_trip(model, tier)`: told each time a breaker
    opens (telemetry.py counts it); `clock` is time.monotonic but in tests."""

    fallbacks: Mapping[str, str] = field(default_factory=dict)
    breaker: BreakerSettings | None = field(default_factory=BreakerSettings)
    clock: Callable[[], float] = time.monotonic
    on_trip: Callable[[str, str], None] | None = None
    _breakers: dict[tuple[str, str], Breaker] = field(default_factory=dict)
    _forgotten_trips: int = 0  # (those of breakers `forget_model` dropped: `trips` never falls)

    def __post_init__(self) -> None:
        for big, small in self.fallbacks.items():
            if big == small or small in self.fallbacks:
                raise ValueError(f"--fallback-model {big}={small}: a fallback must be another model with no "
                                 "fallback of its own (one step down, no chains or cycles)")

    def breaker_for(self, model: str, tier: str, own: BreakerSettings | bool | None = None) -> Breaker | None:
        """The breaker of (model, tier): with the tier's `own` settings (False: none), else the
        server's (`breaker`)."""
        settings = self.breaker if own is None else (own or None)
        if not isinstance(settings, BreakerSettings):
            return None
        found = self._breakers.get((model, tier))
        if found is None or found.settings != settings:
            found = self._breakers[(model, tier)] = Breaker(settings)
        return found

    def admit(self, engine: Any, model: str, ctx: RequestContext, prompt_tokens: int) -> Admission | None:
        """Raise SlaShed if the tier's breaker on `model` is open or the engine's estimate says
        the request would miss its target; None for a tier without one."""
        if ctx.ttft_target_s is None:
            return None
        tier = ctx.tier or ""
        breaker = self.breaker_for(model, tier, ctx.breaker)
        outcome = None
        if breaker is not None:
            try:
                outcome = breaker.admit(self.clock())
            except BreakerOpen as refusal:
                wait = refusal.retry_after
                raise SlaShed(
                    f"model '{model}' missed tier '{tier}''s time-to-first-token target of {ctx.ttft_target_s:g} s "
                    f"for {refusal.misses} of its last {refusal.outcomes} requests, so new ones of that tier are "
                    f"refused for a while (circuit breaker open); retry in {wait} s",
                    model=model, tier=tier, reason="breaker", retry_after=wait) from None
        try:
            estimate = check_ttft_target(engine, model, ctx, prompt_tokens)
        except SlaShed:
            if outcome is not None:
                outcome.report(None, self.clock())  # (a probe's place goes to the next request)
            raise
        return Admission(self, engine, model, tier, ctx.priority, ctx.ttft_target_s, estimate, outcome)

    def _report(self, admission: Admission, met: bool | None) -> None:
        outcome = admission.outcome
        assert outcome is not None
        trips = outcome.breaker.trips
        outcome.report(met, self.clock())
        if outcome.breaker.trips != trips:
            model, tier = admission.model, admission.tier
            if outcome.probe:
                why = "a probe request missed the time-to-first-token target"
            else:
                why = "%d of the last %d requests missed the time-to-first-token target" % outcome.breaker.tripped_by
            logger.warning("SLA breaker for model %s, tier %s opened (%s); new requests of that tier are refused or "
                           "sent to its fallback until probes meet the target again", model, tier, why)
            # The estimate let those requests in: it learns at once that it is too hopeful.
            admission.engine.engine.distrust_ttft_estimate(admission.priority, TRIP_DISTRUST)
            if self.on_trip is not None:
                self.on_trip(model, tier)

    def forget_model(self, model: str) -> None:
        """Drop `model`'s breakers, a LoRA adapter unloaded at run time (as Metrics.forget_model
        its series): else each adapter name that had traffic of a tier with a target kept one for
        good, and a new adapter loaded under that name began with the old one's outcomes (open,
        it was refused). A request of it still running reports to the breaker it was admitted by."""
        for key in [k for k in self._breakers if k[0] == model]:
            self._forgotten_trips += self._breakers.pop(key).trips

    @property
    def trips(self) -> int:
        """Times any of its breakers opened."""
        return self._forgotten_trips + sum(b.trips for b in self._breakers.values())

    def fallback_for(self, model: str) -> str | None:
        return self.fallbacks.get(model)


async def with_fallback(guard: SlaGuard, observer: Any, model: str, start: Callable[[str], Awaitable[T]]) -> tuple[str, T]:
    """`start(model)`, or, if the SLA guard refuses it there, `start(fallback)` where `model`
    has one: (the model that took the request, what start returned). A refusal by both is the
    first one's (it names the model the client asked for), noting the fallback's."""
    try:
        return model, await start(model)
    except SlaShed as shed:
        fallback = guard.fallback_for(model)
        if fallback is None:
            observer.on_shed(model, shed.tier, shed.reason)
            raise
        try:
            result = await start(fallback)
        except SlaShed as again:
            observer.on_shed(model, shed.tier, shed.reason)
            shed.message += f"; its fallback model '{fallback}' is too busy as well"
            if int(again.headers["retry-after"]) < int(shed.headers["retry-after"]):
                shed.headers = dict(again.headers)  # whichever frees first
            raise shed from None
        except ClientDisconnected:
            raise
        except APIError as exc:  # (a prompt too long for its context, a schema it cannot follow, ...)
            # The client asked for `model`: an error of the fallback's own is not its answer.
            observer.on_shed(model, shed.tier, shed.reason)
            shed.message += f"; its fallback model '{fallback}' cannot take this request ({exc.message})"
            raise shed from None
        observer.on_fallback(model, fallback, shed.tier, shed.reason)
        logger.debug("model %s refused a tier '%s' request (%s); served by its fallback %s", model, shed.tier,
                     shed.reason, fallback)  # (one a request under load: tierlm:sla_fallbacks counts them)
        return fallback, result


def fallback_marked(response: R, asked: str, served: str) -> R:
    """`response`, telling the client which model it asked for where a fallback served it."""
    if served != asked:
        response.headers[FALLBACK_HEADER] = asked
    return response
