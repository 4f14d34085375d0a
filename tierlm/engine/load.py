"""How long a new request would wait for its first token: the engine's own estimate.

Why: an SLA guard (serving/sla.py) refuses a request up front when it would miss its tier's
time-to-first-token target anyway, instead of queueing it to be served late, which also delays
everyone behind it. The estimate comes from what the engine knows:

- a step-time model, dt = c0 + c1 * tokens, fitted to every step it has run by least squares
  with exponential forgetting (recent steps count most; the machine's speed and the batch mix
  drift);
- the queue, in steps, the larger of two bounds: the token budget (the prompt tokens still to
  compute of running prefills and of waiting requests at the new request's priority or better,
  which go first, and its own, at what the running decodes leave of each step's budget) and the
  sequence slots (a small simulation: each running request frees its slot after its expected
  output, the mean of the last finished requests' lengths past what it has generated, never past
  its max_tokens; each request ahead takes the next free slot for its prefill and decode steps;
  this one takes the next);
- what keeps arriving ahead of it: requests of a better priority that come while it waits go
  first, so it gets only the capacity they leave. Their requests and prompt tokens per second
  are measured per priority (decayed over ~10 s); the wait is stretched by 1 / (1 - their share
  of the prefill tokens or of the sequence slots, whichever is larger), and is infinite when they
  take all of it.

A cached prefix is not known before the request is admitted, so its whole prompt counts: the
estimate errs on the side of waiting longer.

What the model cannot see (requests of better tiers that overtake one already queued, a machine
slower under load) is learnt from the outcome: each admitted request's first token is compared
with the estimate it was admitted on (`TtftCalibration`), and a factor per priority (from 0.5
to 4) is moved until half the first tokens come within the estimate: a median, which a burst of
misses moves no more than a run of hits (a higher quantile, tried first, climbed during a burst
and then came down too slowly, from the few requests it still admitted, shedding most of gold).
"""
from __future__ import annotations

import bisect
import heapq
import itertools
import math
import threading
import time
from collections import deque


class _Copyable:
    """copy.deepcopy and pickle work though it holds a lock (the copy gets a lock of its own):
    a benchmark starts each run from the same learnt state."""

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()


class StepTimeModel(_Copyable):
    """dt = c0 + c1 * tokens, by exponentially weighted least squares."""

    def __init__(self, half_life_steps: float = 200.0) -> None:
        self.decay = 0.5 ** (1.0 / half_life_steps)
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self._lock = threading.Lock()  # fed on the engine thread, read on the server's
        self.steps = 0

    def observe(self, tokens: int, seconds: float) -> None:
        with self._lock:
            d = self.decay
            self._w = self._w * d + 1.0
            self._x = self._x * d + tokens
            self._y = self._y * d + seconds
            self._xx = self._xx * d + tokens * tokens
            self._xy = self._xy * d + tokens * seconds
            self.steps += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(c0, c1), both at least 0; None before any step."""
        with self._lock:
            if self._w == 0:
                return None
            mx, my = self._x / self._w, self._y / self._w
            var = self._xx / self._w - mx * mx
            if var <= 1e-9 * max(1.0, mx * mx):  # one batch size seen so far: all of it per token
                return 0.0, my / max(mx, 1.0)
            c1 = (self._xy / self._w - mx * my) / var
            c1 = max(c1, 0.0)
            return max(my - c1 * mx, 0.0), c1

    def seconds(self, tokens: int) -> float | None:
        c = self.coefficients()
        return None if c is None else c[0] + c[1] * tokens


LULL = 0.05  # decayed requests under which the arrivals so far count as a finished spell


class ArrivalRates(_Copyable):
    """Requests and prompt tokens arriving per second, per priority, decayed with time constant
    `tau_s`. Over the first seconds of a busy spell the decayed sums cover less than `tau_s`: they
    are divided by the span they do cover (since the spell's first arrival, at least half a
    second), not by `tau_s`, so a burst's rate is seen at once rather than ramped up over ten
    seconds. A lull (the sums decayed to almost nothing: three time constants without an
    arrival, after a single one) starts a new spell."""

    def __init__(self, tau_s: float = 10.0) -> None:
        self.tau = tau_s
        self._sums: dict[int, tuple[float, float, float]] = {}  # priority → (requests, tokens, as of when)
        self._since: float | None = None
        self._lock = threading.Lock()

    def add(self, priority: int, tokens: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if self._since is None or sum(n * math.exp(-(now - at) / self.tau)
                                          for n, _, at in self._sums.values()) < LULL:
                self._since = now  # a new busy spell
            requests, total, at = self._sums.get(priority, (0.0, 0.0, now))
            keep = math.exp(-(now - at) / self.tau)
            self._sums[priority] = (requests * keep + 1, total * keep + tokens, now)

    def rates_before(self, priority: int, now: float | None = None) -> tuple[float, float]:
        """(requests, prompt tokens) per second arriving at priorities better (lower) than `priority`."""
        now = time.monotonic() if now is None else now
        requests = tokens = 0.0
        with self._lock:
            if self._since is None:
                return 0.0, 0.0
            for p, (n, total, at) in self._sums.items():
                if p < priority:
                    keep = math.exp(-(now - at) / self.tau)
                    requests, tokens = requests + n * keep, tokens + total * keep
            # The decayed window the sums cover: tau * (1 - e^(-age/tau)), at least half a second.
            span = self.tau * -math.expm1(-max(0.5, now - self._since) / self.tau)
        return requests / span, tokens / span


class TtftCalibration(_Copyable):
    """Per priority, a factor on the estimate, learnt by quantile tracking in log space: each
    first token later than its estimate raises it by `rate * quantile`, each one within lowers it
    by `rate * (1 - quantile)`, so it settles where a `quantile` share come within."""

    def __init__(self, quantile: float = 0.5, rate: float = 0.1, low: float = 0.5, high: float = 4.0) -> None:
        self.quantile, self.rate = quantile, rate
        self.low, self.high = math.log(low), math.log(high)
        self._log: dict[int, float] = {}
        self.observed: dict[int, int] = {}
        self._lock = threading.Lock()

    def factor(self, priority: int) -> float:
        with self._lock:
            return math.exp(self._log.get(priority, 0.0))

    def observe(self, priority: int, estimate: float, actual: float) -> None:
        """A request of `priority` admitted on `estimate` (the factor applied) got its first token
        after `actual` seconds."""
        if not (math.isfinite(estimate) and math.isfinite(actual)):
            return
        step = self.rate * (self.quantile - (actual <= estimate))
        with self._lock:
            self._log[priority] = min(self.high, max(self.low, self._log.get(priority, 0.0) + step))
            self.observed[priority] = self.observed.get(priority, 0) + 1

    def scale(self, priority: int, by: float) -> None:
        """Multiply the factor at once (within its bounds): what outcomes showed in bulk, e.g. a
        circuit breaker that opened on late first tokens the estimate had let in."""
        with self._lock:
            self._log[priority] = min(self.high, max(self.low, self._log.get(priority, 0.0) + math.log(by)))


class OutputLengths(_Copyable):
    """What the last `window` finished requests generated. A request's `max_tokens` is only a
    ceiling, often far above what it generates; and one that has generated more than most is
    not about to end: its expected length is the mean of the lengths past what it has (E[L |
    L > generated]), which a plain mean would put at its next token. Lengths are heavy-tailed
    (a few long answers among many short ones), and the requests still running are the long
    ones, so the difference is most of a slot's wait."""

    def __init__(self, window: int = 256) -> None:
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] | None = None  # the window sorted, and suffix sums, rebuilt on use
        self._tail_sums: list[int] = []
        self._lock = threading.Lock()

    def add(self, tokens: int) -> None:
        with self._lock:
            self._recent.append(tokens)
            self._sorted = None

    def __len__(self) -> int:
        return len(self._recent)

    def mean(self) -> float | None:
        with self._lock:
            return sum(self._recent) / len(self._recent) if self._recent else None

    def expected_total(self, generated: int) -> float | None:
        """E[L | L > generated] over the window (None: none of them went past it)."""
        with self._lock:
            if self._sorted is None:
                self._sorted = sorted(self._recent)
                self._tail_sums = list(itertools.accumulate(reversed(self._sorted)))[::-1] + [0]
            lengths = self._sorted
            i = bisect.bisect_right(lengths, generated)
            n = len(lengths) - i
            return self._tail_sums[i] / n if n else None


def _decode_steps_left(req, outputs: "OutputLengths | float | None") -> int:
    """Steps until `req` frees its slot: its expected output (given what it has generated, never
    past its max_tokens, and at least one more token) less what it has generated. `outputs`:
    the finished requests' lengths, or one length all are taken to have (None: max_tokens)."""
    done = req.num_output_tokens
    if outputs is None or (isinstance(outputs, OutputLengths) and not outputs):  # nothing finished yet
        expected: float = req.max_tokens
    else:
        total = outputs.expected_total(done) if isinstance(outputs, OutputLengths) else outputs
        expected = min(req.max_tokens, max(total or 0.0, done + 1))
    return max(1, math.ceil(expected) - done)


def estimate_ttft(model: StepTimeModel, *, prompt_tokens: int, priority: int, running: list, waiting: list,
                  budget: int, max_seqs: int, rates: ArrivalRates | None = None,
                  outputs: OutputLengths | float | None = None,
                  now: float | None = None) -> float | None:
    """Seconds until a request of `priority` with `prompt_tokens` would get its first token if it
    arrived now (None: no step measured yet). `running`/`waiting`: the scheduler's requests.

    In steps, the larger of two bounds: the token budget (every prefill token ahead of it, and
    its own, at what the decodes leave of each step) and the sequence slots (each running
    request frees its slot after its expected decode steps, each request ahead takes the next
    free slot for its prefill and decode steps, and this one takes the slot after them)."""
    if model.coefficients() is None:
        return None
    decodes = sum(1 for r in running if r.num_computed_tokens >= r.num_prompt_tokens)
    room = max(1, budget - decodes)  # prefill tokens a step has beside the decodes
    ahead = [r for r in waiting if r.priority <= priority]
    prefill = (sum(max(0, r.num_tokens - r.num_computed_tokens) for r in running if r.num_computed_tokens
                   < r.num_prompt_tokens) + sum(r.num_tokens - r.num_computed_tokens for r in ahead) + prompt_tokens)
    token_steps = math.ceil(prefill / room)
    # Sequence slots, as a small simulation of when each frees.
    free_at = [0] * max(0, max_seqs - len(running))
    free_at += [math.ceil(max(0, r.num_prompt_tokens - r.num_computed_tokens) / room)
                + _decode_steps_left(r, outputs) for r in running]
    heapq.heapify(free_at)
    for r in sorted(ahead, key=lambda r: (r.priority, r.arrival_time, r.arrival_seq)):
        start = heapq.heappop(free_at)
        heapq.heappush(free_at, start + math.ceil((r.num_tokens - r.num_computed_tokens) / room)
                       + _decode_steps_left(r, outputs))
    slot_steps = free_at[0] + math.ceil(prompt_tokens / room) if free_at else token_steps
    steps = max(token_steps, slot_steps)
    step = model.seconds(min(budget, decodes + min(room, prefill)))  # a step at the present load
    seconds = steps * step
    if rates is not None and seconds > 0:
        # The share better tiers' arrivals take, of prefill tokens or of sequence slots (each
        # holds one for its prefill, at a full step's time per `room` tokens, and its expected
        # decode steps, each a step at the present load: a full one while a queue waits, a
        # short one on an idle engine), whichever they take more of. Decode steps once always
        # counted as full steps: with one slot, a single long gold answer made its tier look
        # like it took the whole engine for 20 s after it ended, on an idle engine.
        full = max(model.seconds(min(budget, decodes + room)), 1e-9)
        decode = max(step, 1e-9)
        requests, tokens = rates.rates_before(priority, now)
        mean_output = outputs.mean() if isinstance(outputs, OutputLengths) else outputs
        held = ((tokens / requests / room * full if requests else 0.0)
                + (mean_output or 1.0) * decode)  # seconds a slot is held
        taken = max(tokens * full / room, requests * held / max_seqs)
        if taken >= 1:
            return math.inf
        seconds /= 1 - taken
    return seconds
