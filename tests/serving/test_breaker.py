"""The SLA circuit breaker (tierlm/serving/breaker.py) on a clock the test drives: when it
opens, how long it refuses, how probes close or reopen it, what it forgets; and the guard's
use of it (sla.py): a miss is counted the moment a target passes, an engine failure is a miss,
a client's leaving is not."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierlm.serving.auth import RequestContext
from tierlm.serving.breaker import Breaker, BreakerOpen, BreakerSettings, BreakerState
from tierlm.serving.errors import ClientDisconnected, InternalError, InvalidRequest
from tierlm.serving.sla import SlaGuard, SlaShed

SMALL = BreakerSettings(window=4, horizon_s=10.0, min_outcomes=3, trip_fraction=0.5, cooldown_s=1.0,
                        max_cooldown_s=3.0, probes=2)


def outcomes(breaker: Breaker, now: float, *met: bool | None) -> None:
    for m in met:
        breaker.admit(now).report(m, now)


def test_it_opens_once_enough_outcomes_are_misses():
    b = Breaker(SMALL)
    outcomes(b, 0.0, False, False)  # two misses of two: fewer than min_outcomes
    assert b.state is BreakerState.CLOSED
    outcomes(b, 0.0, True)  # 2 of 3 missed >= half
    assert b.state is BreakerState.OPEN and b.trips == 1
    with pytest.raises(BreakerOpen) as refused:
        b.admit(0.25)
    assert refused.value.retry_after_s == pytest.approx(0.75) and refused.value.retry_after == 1
    assert (refused.value.misses, refused.value.outcomes) == (2, 3)


def test_below_the_fraction_it_stays_closed_and_the_window_slides():
    b = Breaker(SMALL)
    outcomes(b, 0.0, True, True, False, True)  # 1 of 4
    outcomes(b, 0.0, True, False)  # the window keeps the last 4: F T T F -> 2 of 4 = half
    assert b.state is BreakerState.OPEN
    b = Breaker(SMALL)
    outcomes(b, 0.0, True, True, True, False)
    outcomes(b, 0.0, True)  # T T T F T -> last 4: T T F T, 1 of 4
    assert b.state is BreakerState.CLOSED and b.misses(0.0) == (1, 4)


def test_outcomes_past_the_horizon_are_forgotten():
    b = Breaker(SMALL)
    outcomes(b, 0.0, False, False)
    assert b.misses(10.0) == (2, 2)
    outcomes(b, 10.5, True)  # the two misses are now older than 10 s: one outcome kept, no trip
    assert b.state is BreakerState.CLOSED and b.misses(10.5) == (0, 1)


def test_probes_that_meet_the_target_close_it_and_reset_the_cooldown():
    b = Breaker(SMALL)
    outcomes(b, 0.0, False, False, False)
    first, second = b.admit(1.0), b.admit(1.0)  # cool-down over: two probes, no more
    assert b.state is BreakerState.HALF_OPEN and first.probe and second.probe
    with pytest.raises(BreakerOpen):
        b.admit(1.0)
    first.report(True, 1.2)
    with pytest.raises(BreakerOpen):  # a probe still out: its place is not given away
        b.admit(1.2)
    second.report(True, 1.3)
    assert b.state is BreakerState.CLOSED and b.misses(1.3) == (0, 0)
    outcomes(b, 2.0, False, False, False)
    with pytest.raises(BreakerOpen) as refused:
        b.admit(2.0)
    assert refused.value.retry_after_s == pytest.approx(1.0)  # back to the first cool-down


def test_a_missed_probe_reopens_it_for_twice_as_long_up_to_the_cap():
    b = Breaker(SMALL)
    outcomes(b, 0.0, False, False, False)  # open until 1.0
    now, spells = 1.0, []
    for _ in range(3):
        probe = b.admit(now)
        probe.report(False, now)
        with pytest.raises(BreakerOpen) as refused:
            b.admit(now)
        spells.append(refused.value.retry_after_s)
        now += refused.value.retry_after_s
    assert spells == pytest.approx([2.0, 3.0, 3.0]) and b.trips == 4


def test_a_probe_without_a_verdict_gives_its_place_to_the_next_request():
    b = Breaker(SMALL)
    outcomes(b, 0.0, False, False, False)
    left, stays = b.admit(1.0), b.admit(1.0)
    left.report(None, 1.1)  # the client left (or the estimate refused it after all)
    replacement = b.admit(1.1)
    assert replacement.probe
    stays.report(True, 1.2)
    replacement.report(True, 1.3)
    assert b.state is BreakerState.CLOSED


def test_outcomes_of_an_earlier_spell_are_ignored():
    b = Breaker(SMALL)
    late = [b.admit(0.0) for _ in range(3)]  # admitted while closed, report after it opened
    outcomes(b, 0.0, False, False, False)
    for ticket in late:
        ticket.report(False, 0.5)
    assert b.trips == 1
    probes = [b.admit(1.0), b.admit(1.0)]
    for p in probes:
        p.report(True, 1.1)
    late_again = b.admit(1.2)
    assert not late_again.probe and b.state is BreakerState.CLOSED
    late_again.report(False, 1.2)
    late_again.report(True, 1.2)  # a second report of one ticket counts for nothing
    assert b.misses(1.2) == (1, 1)


@pytest.mark.parametrize("bad", [dict(window=0), dict(min_outcomes=5, window=4), dict(trip_fraction=0),
                                 dict(trip_fraction=1.5), dict(cooldown_s=0), dict(cooldown_s=5, max_cooldown_s=1),
                                 dict(probes=0), dict(horizon_s=0)])
def test_settings_are_checked(bad):
    with pytest.raises(ValueError, match="breaker"):
        BreakerSettings(**bad)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 3), st.sampled_from([True, False, None])), max_size=60))
def test_against_a_reference_of_its_rules(events):
    """Any sequence of requests (time steps, verdicts) reported at once: a reference written from
    the docstring's rules agrees on every admit and refusal."""
    b = Breaker(SMALL)
    state, kept, open_until, cooldown, passed = "closed", [], 0.0, SMALL.cooldown_s, 0
    now = 0.0
    for step, met in events:
        now += step
        if state == "open" and now >= open_until:
            state, passed = "half", 0
        expect_refused = state == "open"
        try:
            ticket = b.admit(now)
        except BreakerOpen:
            assert expect_refused
            continue
        assert not expect_refused
        ticket.report(met, now)
        if state == "half":
            if met is False:
                state, open_until, cooldown = "open", now + cooldown, min(SMALL.max_cooldown_s, cooldown * 2)
            elif met:
                passed += 1
                if passed == SMALL.probes:
                    state, kept, cooldown = "closed", [], SMALL.cooldown_s
        elif met is not None:
            kept = [(t, m) for t, m in kept + [(now, met)] if t >= now - SMALL.horizon_s][-SMALL.window:]
            if len(kept) >= SMALL.min_outcomes and sum(not m for _, m in kept) >= SMALL.trip_fraction * len(kept):
                state, open_until, cooldown = "open", now + cooldown, min(SMALL.max_cooldown_s, cooldown * 2)
                kept = []
        assert b.state.value == {"closed": "closed", "open": "open", "half": "half_open"}[state]


# ---- the guard's use of it -------------------------------------------------------------


class _FixedEstimate:
    """An engine whose estimate is fixed, with requests in it unless `idle` (the guard only asks
    it for those)."""

    def __init__(self, estimate: float | None, idle: bool = False) -> None:
        self.engine = self
        self.estimate, self.idle = estimate, idle
        self.distrusted: list[tuple[int, float]] = []

    def estimate_ttft(self, prompt_tokens: int, priority: int = 0) -> float | None:
        return self.estimate

    def has_unfinished(self) -> bool:
        return not self.idle

    def distrust_ttft_estimate(self, priority: int, by: float) -> None:
        self.distrusted.append((priority, by))


def _ctx(target_s: float | None = 0.05) -> RequestContext:
    return RequestContext(request_id="r", tier="gold", priority=0, ttft_target_s=target_s)


def test_a_miss_is_counted_when_the_target_passes_not_when_the_first_token_comes():
    guard = SlaGuard(breaker=SMALL)

    async def run() -> tuple[tuple[int, int], tuple[int, int]]:
        admission = guard.admit(_FixedEstimate(None), "m", _ctx(0.05), 10)
        admission.start()
        await asyncio.sleep(0.1)  # past the target, no first token yet
        during = guard.breaker_for("m", "gold").misses(guard.clock())
        admission.first_token(0.5)  # its late first token counts no second time
        return during, guard.breaker_for("m", "gold").misses(guard.clock())

    assert asyncio.run(run()) == ((1, 1), (1, 1))


def test_engine_failures_are_misses_and_a_client_leaving_is_not():
    guard = SlaGuard(breaker=SMALL)

    async def run() -> None:
        for exc in (ClientDisconnected("gone"), InvalidRequest("bad schema"), InternalError("device fault")):
            admission = guard.admit(_FixedEstimate(None), "m", _ctx(10.0), 10)
            admission.start()
            admission.failed(exc)
        ok = guard.admit(_FixedEstimate(None), "m", _ctx(10.0), 10)
        ok.start()
        ok.first_token(0.01)

    asyncio.run(run())
    assert guard.breaker_for("m", "gold").misses(guard.clock()) == (1, 2)


def test_an_open_breaker_refuses_before_the_estimate_and_the_estimate_frees_a_probe():
    clock = [0.0]
    trips: list[tuple[str, str]] = []
    guard = SlaGuard(breaker=SMALL, clock=lambda: clock[0], on_trip=lambda m, t: trips.append((m, t)))
    engine = _FixedEstimate(None)
    for _ in range(3):
        guard.admit(engine, "m", _ctx(), 10)._report(False)
    assert trips == [("m", "gold")]
    assert engine.distrusted == [(0, 2.0)]  # the estimate that let them in is told at once
    with pytest.raises(SlaShed) as shed:
        guard.admit(_FixedEstimate(0.0), "m", _ctx(), 10)  # the estimate would admit it
    assert shed.value.reason == "breaker" and shed.value.headers["retry-after"] == "1"
    assert "missed tier 'gold''s time-to-first-token target of 0.05 s for 3 of its last 3 requests" in shed.value.message
    assert guard.admit(_FixedEstimate(None), "other", _ctx(), 10) is not None  # per model
    assert guard.admit(_FixedEstimate(None), "m", _ctx(None), 10) is None  # a tier without a target: no breaker
    clock[0] = 1.0
    for _ in range(3):  # half-open: the estimate refuses each probe, whose place goes to the next
        with pytest.raises(SlaShed) as shed:
            guard.admit(_FixedEstimate(9.0), "m", _ctx(), 10)
        assert shed.value.reason == "estimate"
    probes = [guard.admit(_FixedEstimate(None), "m", _ctx(), 10) for _ in range(2)]
    assert all(p.outcome.probe for p in probes)


def test_an_idle_engine_is_not_shed_on_its_estimate_and_learns_from_what_it_admits():
    """Nothing running or waiting: shedding frees nothing, and the admitted request is how a
    stale estimate (a slowdown's) learns again; with work in the engine the same estimate sheds."""
    guard = SlaGuard(breaker=None)
    admitted = guard.admit(_FixedEstimate(9.0, idle=True), "m", _ctx(), 10)
    assert admitted is not None and admitted.estimate == 9.0  # the first token will tell it how far off it was
    with pytest.raises(SlaShed) as shed:
        guard.admit(_FixedEstimate(9.0), "m", _ctx(), 10)
    assert shed.value.reason == "estimate"


def test_fallbacks_are_one_step_down():
    SlaGuard(fallbacks={"big": "small", "huge": "small"})
    for bad in ({"big": "big"}, {"big": "mid", "mid": "small"}):
        with pytest.raises(ValueError, match="one step down"):
            SlaGuard(fallbacks=bad)


def test_a_tiers_own_breaker_settings_or_none_override_the_servers():
    """Tiers of one server, one model: gold's breaker is off (`breaker = false`), silver trips
    after 2 misses of 2 (its own settings), bronze keeps the server's (3 of 3, SMALL); with the
    server's breaker off (--no-sla-breaker), a tier's own settings still hold."""
    import dataclasses

    own = BreakerSettings(window=2, min_outcomes=2, cooldown_s=0.5, max_cooldown_s=1.0, probes=1)
    clock = [0.0]

    def ctx(tier: str, breaker) -> RequestContext:
        return dataclasses.replace(_ctx(), tier=tier, breaker=breaker)

    def misses_until_refused(guard: SlaGuard, tier: str, breaker) -> int | None:
        for n in range(1, 30):
            guard.admit(_FixedEstimate(None), "m", ctx(tier, breaker), 10)._report(False)
            try:
                guard.admit(_FixedEstimate(None), "m", ctx(tier, breaker), 10)._report(None)
            except SlaShed as shed:
                assert shed.reason == "breaker"
                return n
        return None

    guard = SlaGuard(breaker=SMALL, clock=lambda: clock[0])
    assert misses_until_refused(guard, "gold", False) is None and guard.breaker_for("m", "gold", False) is None
    assert misses_until_refused(guard, "silver", own) == 2
    assert misses_until_refused(guard, "bronze", None) == 3
    with pytest.raises(SlaShed) as shed:
        guard.admit(_FixedEstimate(None), "m", ctx("silver", own), 10)
    assert shed.value.headers["retry-after"] == "1"  # its own 0.5 s cool-down, in whole seconds
    clock[0] = 0.6  # silver's cool-down is over; bronze's (SMALL's 1 s) is not
    guard.admit(_FixedEstimate(None), "m", ctx("silver", own), 10)
    with pytest.raises(SlaShed):
        guard.admit(_FixedEstimate(None), "m", ctx("bronze", None), 10)
    off = SlaGuard(breaker=None, clock=lambda: clock[0])
    assert misses_until_refused(off, "bronze", None) is None
    assert misses_until_refused(off, "silver", own) == 2
