"""A circuit breaker on measured time to first token, one per (model, tier) with a target.

Why, beside the SLA guard's estimate (sla.py, engine/load.py): the estimate is a model of the
engine and can be wrong in ways only outcomes show (a burst of better tiers that arrived after
a request was admitted, a slower step than fitted, other work on the machine, an engine that
fails). The breaker watches what happened instead: the last `window` outcomes of the tier on
that model within `horizon_s` (an outcome is a miss when the first token came after the
target, when the target passed with no first token yet, or when the engine failed the
request). Once at least `min_outcomes` are in and `trip_fraction` of them are misses, it opens:
new requests of that tier are refused for a cool-down. Then it lets `probes` requests through;
if all of them meet the target it closes, if one misses it opens again for twice as long (up to
`max_cooldown_s`): a lasting overload is refused with growing retry-after, a passing one costs
one short cool-down. A closed breaker forgets its outcomes when it reopens or closes, so what
tripped it once does not trip it again.

Pure bookkeeping on a clock passed in by the caller: tested exactly, no timing in the tests.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from enum import Enum


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass(frozen=True)
class BreakerSettings:
    window: int = 20  # outcomes kept
    horizon_s: float = 30.0  # outcomes older than this are forgotten
    min_outcomes: int = 8  # fewer than this never trip it
    trip_fraction: float = 0.5  # the share of misses among the kept outcomes that opens it
    cooldown_s: float = 1.0  # the first open spell; doubled on each reopening without a close
    max_cooldown_s: float = 30.0
    probes: int = 2  # requests let through after a cool-down, all of which must meet the target

    def __post_init__(self) -> None:
        if self.window < 1 or not 1 <= self.min_outcomes <= self.window:
            raise ValueError(f"breaker: need 1 <= min_outcomes ({self.min_outcomes}) <= window ({self.window})")
        if not 0 < self.trip_fraction <= 1:
            raise ValueError(f"breaker: trip_fraction must be in (0, 1] (got {self.trip_fraction})")
        if not 0 < self.cooldown_s <= self.max_cooldown_s:
            raise ValueError(f"breaker: need 0 < cooldown_s ({self.cooldown_s}) <= max_cooldown_s "
                             f"({self.max_cooldown_s})")
        if self.probes < 1 or self.horizon_s <= 0:
            raise ValueError("breaker: probes must be at least 1 and horizon_s positive")


class BreakerOpen(Exception):
    """Refused by an open breaker; `retry_after_s`: when it will next let a request through."""

    def __init__(self, retry_after_s: float, misses: int, outcomes: int) -> None:
        super().__init__(f"breaker open for {retry_after_s:.1f} s more")
        self.retry_after_s = retry_after_s
        self.misses = misses  # what tripped it
        self.outcomes = outcomes

    @property
    def retry_after(self) -> int:
        """Whole seconds for a retry-after header (at least 1)."""
        return max(1, math.ceil(self.retry_after_s))


@dataclass
class Outcome:
    """One admitted request's ticket: `report` it once (later reports are ignored)."""

    breaker: "Breaker"
    epoch: int  # the breaker's spell it was admitted in: outcomes of an earlier spell are stale
    probe: bool
    reported: bool = False

    def report(self, met: bool | None, now: float) -> None:
        """`met`: True (first token within the target), False (a miss or an engine failure),
        None (no verdict: the client left or the request was refused after all)."""
        if self.reported:
            return
        self.reported = True
        self.breaker._report(self, met, now)


@dataclass
class Breaker:
    settings: BreakerSettings = field(default_factory=BreakerSettings)
    state: BreakerState = BreakerState.CLOSED
    trips: int = 0  # how many times it opened
    _outcomes: deque = field(default_factory=deque)  # (time, met) of this spell, oldest first
    _epoch: int = 0
    _open_until: float = 0.0
    _cooldown: float = 0.0  # the next open spell's length
    _probes_out: int = 0  # probes admitted and not yet reported (half-open)
    _probes_passed: int = 0
    _tripped_by: tuple[int, int] = (0, 0)  # (misses, outcomes) when it last opened

    def __post_init__(self) -> None:
        self._cooldown = self.settings.cooldown_s

    def admit(self, now: float) -> Outcome:
        """A ticket for a request starting now, or BreakerOpen."""
        s = self.settings
        if self.state is BreakerState.OPEN:
            if now < self._open_until:
                raise BreakerOpen(self._open_until - now, *self._tripped_by)
            self.state, self._probes_out, self._probes_passed = BreakerState.HALF_OPEN, 0, 0
        if self.state is BreakerState.HALF_OPEN:
            if self._probes_out + self._probes_passed >= s.probes:  # probes still out: wait for them
                raise BreakerOpen(s.cooldown_s, *self._tripped_by)
            self._probes_out += 1
            return Outcome(self, self._epoch, probe=True)
        return Outcome(self, self._epoch, probe=False)

    @property
    def tripped_by(self) -> tuple[int, int]:
        """(misses, outcomes) kept when it last opened on its window ((0, 0) before; a missed
        probe reopens it without changing this)."""
        return self._tripped_by

    @property
    def refusing_until(self) -> float:
        """When an open breaker's cool-down ends (its clock's time; 0 unless open)."""
        return self._open_until if self.state is BreakerState.OPEN else 0.0

    def misses(self, now: float) -> tuple[int, int]:
        """(misses, outcomes) among those kept at `now`."""
        self._forget(now)
        return sum(not met for _, met in self._outcomes), len(self._outcomes)

    def _forget(self, now: float) -> None:
        while self._outcomes and (len(self._outcomes) > self.settings.window
                                  or self._outcomes[0][0] < now - self.settings.horizon_s):
            self._outcomes.popleft()

    def _report(self, outcome: Outcome, met: bool | None, now: float) -> None:
        if outcome.epoch != self._epoch:
            return  # admitted before the breaker last opened or closed: that spell is over
        if outcome.probe:
            self._probes_out -= 1
            if met is False:
                self._open(now)
            elif met:
                self._probes_passed += 1
                if self._probes_passed >= self.settings.probes:
                    self._close()
            return
        if met is None or self.state is not BreakerState.CLOSED:
            return
        self._outcomes.append((now, met))
        misses, outcomes = self.misses(now)
        if outcomes >= self.settings.min_outcomes and misses >= self.settings.trip_fraction * outcomes - 1e-9:
            self._tripped_by = (misses, outcomes)
            self._open(now)

    def _open(self, now: float) -> None:
        self.state, self.trips = BreakerState.OPEN, self.trips + 1
        self._open_until = now + self._cooldown
        self._cooldown = min(self.settings.max_cooldown_s, self._cooldown * 2)
        self._new_spell()

    def _close(self) -> None:
        self.state, self._cooldown = BreakerState.CLOSED, self.settings.cooldown_s
        self._new_spell()

    def _new_spell(self) -> None:
        self._epoch += 1
        self._outcomes.clear()
        self._probes_out = self._probes_passed = 0
