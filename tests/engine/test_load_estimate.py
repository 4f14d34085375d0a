"""The engine's time-to-first-token estimate (engine/load.py): the step-time fit against exact
data, the queue arithmetic against a hand computation, and a real engine's estimate moving
with the work ahead of a request at its priority."""
from __future__ import annotations

import math

import pytest

from tierlm import LLM, SamplingParams
from tierlm.engine.load import StepTimeModel, estimate_ttft
from tierlm.engine.request import Request


def test_the_step_time_fit_recovers_a_line_and_forgets_old_steps():
    m = StepTimeModel(half_life_steps=20)
    assert m.coefficients() is None and m.seconds(10) is None
    for n in (1, 8, 64, 256, 3, 100) * 5:
        m.observe(n, 0.004 + 0.0001 * n)
    c0, c1 = m.coefficients()
    assert c0 == pytest.approx(0.004) and c1 == pytest.approx(0.0001)
    for n in (1, 8, 64, 256, 3, 100) * 40:  # the machine got twice as slow: the fit follows
        m.observe(n, 2 * (0.004 + 0.0001 * n))
    assert m.seconds(100) == pytest.approx(2 * 0.014, rel=0.01)


def test_one_batch_size_seen_is_charged_per_token_and_nothing_goes_negative():
    m = StepTimeModel()
    m.observe(50, 0.05)
    assert m.coefficients() == (0.0, pytest.approx(0.001))
    m2 = StepTimeModel()
    for n, dt in ((1, 0.5), (100, 0.01)):  # bigger steps faster (noise): no negative per-token cost
        m2.observe(n, dt)
    c0, c1 = m2.coefficients()
    assert c1 == 0.0 and c0 > 0


def _req(priority: int, prompt: int, computed: int = 0, outputs: int = 0, max_tokens: int = 50) -> Request:
    r = Request("r", list(range(prompt)), SamplingParams(), max_tokens, frozenset(), priority=priority)
    r.num_computed_tokens = computed
    for _ in range(outputs):
        r.append_token(1)
    return r


def test_the_estimate_counts_work_ahead_at_its_priority_decodes_and_slots():
    m = StepTimeModel()
    for n in (1, 64):
        m.observe(n, 0.01 + 0.001 * n)  # c0 = 10 ms, c1 = 1 ms per token
    running = [_req(0, 10, computed=10, outputs=1, max_tokens=5), _req(2, 10, computed=10, outputs=1, max_tokens=30)]
    waiting = [_req(0, 100), _req(2, 1000)]
    kw = dict(running=running, waiting=waiting, budget=64, max_seqs=4)
    # gold: 100 ahead + 20 of its own, 62 a step beside the 2 decodes: 2 full steps of 64 tokens
    # (two slots are free: the slot bound, 1 step, is the smaller).
    step = 0.01 + 0.064
    assert estimate_ttft(m, prompt_tokens=20, priority=0, **kw) == pytest.approx(2 * step)
    # bronze: 1,120 tokens ahead and its own, 19 steps; its slot comes sooner (after 4 steps,
    # when the running gold request is done: the two free ones go to the two ahead of it).
    assert estimate_ttft(m, prompt_tokens=20, priority=2, **kw) == pytest.approx(19 * step)
    # Two slots, both taken: the gold ahead of it gets the first to free (after 4 steps) for
    # 2 prefill + 50 decode steps; the bronze running one frees at 29, so a gold request starts
    # then: 29 + 1 steps, past the token bound.
    kw["max_seqs"] = 2
    assert estimate_ttft(m, prompt_tokens=20, priority=0, **kw) == pytest.approx(30 * step)
    # Finished requests generated 10 tokens on average: the bronze one frees after 9 steps, the
    # gold one ahead takes the first at 4 and holds it to 16, so a gold request starts at 9 + 1.
    assert estimate_ttft(m, prompt_tokens=20, priority=0, outputs=10, **kw) == pytest.approx(10 * step)
    assert estimate_ttft(StepTimeModel(), prompt_tokens=20, priority=0, **kw) is None


def test_a_real_engines_estimate_grows_with_the_work_ahead_of_its_priority(llama_dir):
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_memory=2 << 20, max_model_len=256, block_size=8,
              max_num_batched_tokens=32, load_progress=False, warmup=False)
    eng = llm.engine
    assert eng.estimate_ttft(10) is None  # no step yet: no guess
    llm.generate([{"prompt_token_ids": list(range(5, 60))}], SamplingParams(max_tokens=4, ignore_eos=True))
    idle = eng.estimate_ttft(10)
    assert idle is not None and idle > 0
    for _ in range(3):
        eng.add_request({"prompt_token_ids": list(range(5, 100))}, SamplingParams(max_tokens=2), priority=2)
    assert eng.estimate_ttft(10, priority=0) == pytest.approx(idle)  # bronze work waits behind gold
    assert eng.estimate_ttft(10, priority=2) > 5 * idle  # 295 tokens ahead, 32 a step
    while eng.has_unfinished():
        eng.step()


def test_better_tiers_arrivals_stretch_the_wait_and_can_take_it_all():
    from tierlm.engine.load import ArrivalRates
    m = StepTimeModel()
    for n in (1, 64):
        m.observe(n, 0.01 + 0.001 * n)
    kw = dict(running=[], waiting=[], budget=64, max_seqs=4, now=100.0)
    rates = ArrivalRates(tau_s=10)
    alone = estimate_ttft(m, prompt_tokens=20, priority=2, **kw)
    assert alone == pytest.approx(0.01 + 0.020)  # one 20-token step
    # Gold: 10 requests of 30 tokens a second for the last 10 s (the decayed sums divided by the
    # span they cover since the first arrival: 10/s and 300 tokens/s). A full step (64 tokens)
    # takes 74 ms, a step at the present load (nothing queued: this request's 20 tokens) 30 ms:
    # gold takes ~35% of the prefill tokens, and of the 4 slots, each held for its prefill
    # (30/64 of a full step) and its expected output (10 tokens: 10 steps), ~84%: the wait
    # stretches. With 30 tokens out, ~234%: more than all of them.
    for t in range(100):
        rates.add(0, 30, now=90.0 + t * 0.1)
    requests, tokens = rates.rates_before(2, now=100.0)
    decayed = sum(math.exp(-(10 - t * 0.1) / 10) for t in range(100))
    assert requests == pytest.approx(decayed / (10 * (1 - math.exp(-1)))) and requests == pytest.approx(10, rel=0.01)
    assert tokens == pytest.approx(30 * requests)
    assert rates.rates_before(0, now=100.0) == (0.0, 0.0)  # nothing is better than gold
    held = 30 / 64 * 0.074 + 10 * 0.030
    assert estimate_ttft(m, prompt_tokens=20, priority=2, rates=rates, outputs=10, **kw) == pytest.approx(
        alone / (1 - requests * held / 4))
    assert estimate_ttft(m, prompt_tokens=20, priority=2, rates=rates, outputs=30, **kw) == float("inf")
    # With one expected output token each and 64 slots they take ~2% of the slots, less than the
    # 35% of the tokens: the tokens' share stretches the wait.
    kw["max_seqs"] = 64
    taken = tokens * 0.074 / 64
    assert estimate_ttft(m, prompt_tokens=20, priority=2, rates=rates, outputs=1, **kw) == pytest.approx(
        alone / (1 - taken))
    assert estimate_ttft(m, prompt_tokens=20, priority=0, rates=rates, outputs=1, **kw) == pytest.approx(alone)
    for t in range(100):
        rates.add(1, 300, now=90.0 + t * 0.1)  # silver takes the rest of the tokens
    assert estimate_ttft(m, prompt_tokens=20, priority=2, rates=rates, outputs=1, **kw) == float("inf")


def test_one_gold_answer_on_a_single_slot_does_not_take_the_whole_engine_after_it_ends():
    """A tester's case: one slot, one long gold request (1,500 prompt tokens, ~100 out). Its
    decode steps were costed as full prefill steps, so for ~20 s after it ended its tier seemed
    to take more than the engine (an infinite estimate: bronze shed with retry-after 30 on an
    idle engine). Costed as steps at the present load (idle: this request's 20 tokens), it takes
    part of the slot: the wait stretches. Behind a queue each step is a full one, as before."""
    from tierlm.engine.load import ArrivalRates
    m = StepTimeModel()
    for n in (1, 64):
        m.observe(n, 0.01 + 0.001 * n)
    rates = ArrivalRates(tau_s=10)
    rates.add(0, 1500, now=0.0)
    kw = dict(running=[], waiting=[], budget=64, max_seqs=1, now=5.0)
    alone = estimate_ttft(m, prompt_tokens=20, priority=2, **kw)
    stretched = estimate_ttft(m, prompt_tokens=20, priority=2, rates=rates, outputs=100, **kw)
    requests, tokens = rates.rates_before(2, now=5.0)
    held = 1500 / 64 * 0.074 + 100 * 0.030  # its prefill at full steps, its answer at the present load's steps
    assert requests * held < 1 and stretched == pytest.approx(alone / (1 - max(tokens * 0.074 / 64, requests * held)))
    assert math.isfinite(stretched) and stretched < 5 * alone
    # The same gold answer with 2,000 prefill tokens queued ahead: every step a full one, the
    # slot held for more than the engine has: as good as taken.
    queued = [_req(0, 2000, max_tokens=100)]
    assert requests * (1500 / 64 * 0.074 + 100 * 0.074) >= 1
    assert estimate_ttft(m, prompt_tokens=20, priority=2, rates=rates, outputs=100,
                         **{**kw, "waiting": queued}) == float("inf")


def test_the_calibration_settles_where_half_the_first_tokens_come_within_the_estimate():
    """Actual waits are the raw estimate times a lognormal factor (median 2: the model sees half
    the wait); the learnt factor settles near 2, with half of them within the corrected estimate."""
    import random

    from tierlm.engine.load import TtftCalibration
    cal, rng = TtftCalibration(), random.Random(0)
    assert cal.factor(2) == 1.0
    within = []
    for i in range(6000):
        raw = rng.uniform(0.1, 3.0)
        estimate = raw * cal.factor(2)
        actual = raw * math.exp(rng.gauss(math.log(2), 0.3))
        cal.observe(2, estimate, actual)
        if i >= 3000:
            within.append(actual <= estimate)
    assert sum(within) / len(within) == pytest.approx(0.5, abs=0.05)
    assert 1.7 < cal.factor(2) < 2.3
    assert cal.factor(0) == 1.0 and cal.observed == {2: 6000}  # per priority
    cal.observe(0, float("inf"), 1.0)  # nothing learnt from an infinite estimate
    assert cal.observed == {2: 6000}
    for _ in range(200):  # a long run of misses: bounded
        cal.observe(1, 1.0, 100.0)
    assert cal.factor(1) == pytest.approx(4.0)


def test_arrival_rates_see_a_burst_at_once_and_a_lull_starts_afresh():
    from tierlm.engine.load import ArrivalRates
    rates = ArrivalRates(tau_s=10)
    for t in range(20):  # 20 requests a second for one second, right after start
        rates.add(0, 100, now=t * 0.05)
    requests, _ = rates.rates_before(1, now=1.0)
    assert requests == pytest.approx(20, rel=0.1)  # not 2/s, as dividing by the full 10 s would say
    # A minute of silence, then 4 a second: the old burst neither dilutes nor inflates the new rate.
    for t in range(8):
        rates.add(0, 100, now=61.0 + t * 0.25)
    requests, _ = rates.rates_before(1, now=63.0)
    assert requests == pytest.approx(4, rel=0.15)


def test_a_long_running_answer_is_expected_to_run_on_as_the_long_ones_did():
    """Lengths 10 (nine in ten) and 500: the mean is 59, but an answer past 10 tokens is one of
    the long ones, with 500 - generated to go, not one more token."""
    from tierlm.engine.load import OutputLengths
    lengths = OutputLengths(window=10)
    assert lengths.expected_total(0) is None and lengths.mean() is None
    for n in [10] * 9 + [500]:
        lengths.add(n)
    assert lengths.mean() == 59
    assert lengths.expected_total(0) == 59 and lengths.expected_total(9) == 59
    assert lengths.expected_total(10) == 500 and lengths.expected_total(499) == 500
    assert lengths.expected_total(500) is None  # none went further: one more token, as before
    lengths.add(20)  # the window keeps the last 10: one 10 leaves
    assert lengths.mean() == pytest.approx((8 * 10 + 500 + 20) / 10)
    assert lengths.expected_total(10) == pytest.approx(260)

    m = StepTimeModel()
    for n in (1, 64):
        m.observe(n, 0.01 + 0.001 * n)
    step = 0.01 + 0.002  # the running decode and the new request's one prompt token
    running = [_req(0, 10, computed=10, outputs=100, max_tokens=1000)]
    kw = dict(running=running, waiting=[], budget=64, max_seqs=1)
    # nothing finished yet: it is expected to run to its max_tokens
    assert estimate_ttft(m, prompt_tokens=1, priority=0, outputs=OutputLengths(), **kw) == pytest.approx(901 * step)
    # One slot, held by an answer 100 tokens long: with the mean (59) it would end next step;
    # as one of the long ones it has 400 to go, then the new one-token prompt takes one more.
    assert estimate_ttft(m, prompt_tokens=1, priority=0, outputs=59.0, **kw) == pytest.approx(2 * step)
    assert estimate_ttft(m, prompt_tokens=1, priority=0, outputs=lengths, **kw) == pytest.approx((500 - 100 + 1) * step)
    running[0].max_tokens = 300  # never past its ceiling
    assert estimate_ttft(m, prompt_tokens=1, priority=0, outputs=lengths, **kw) == pytest.approx((300 - 100 + 1) * step)


def test_the_calibration_scales_at_once_within_its_bounds():
    from tierlm.engine.load import TtftCalibration
    cal = TtftCalibration(low=0.5, high=4.0)
    cal.scale(2, 2.0)
    assert cal.factor(2) == pytest.approx(2.0) and cal.factor(0) == 1.0
    cal.scale(2, 2.0)
    cal.scale(2, 2.0)
    assert cal.factor(2) == pytest.approx(4.0)  # capped
    for _ in range(20):  # first tokens well within the estimate bring it back down, a step each
        cal.observe(2, 1.0, 0.1)
    assert cal.factor(2) == pytest.approx(4.0 * math.exp(-20 * 0.05))
