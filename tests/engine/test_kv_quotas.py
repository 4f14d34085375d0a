"""Per-tenant KV quotas (engine/quotas.py) on a real tiny model; the peer is the same engine
and traffic without a quota, which shows the tenant taking more of the pool."""
from __future__ import annotations

import random

import pytest

from tierlm import SamplingParams
from tierlm.engine.fairness import tenant_of
from tests.engine.test_fair_scheduling import _engine

_rng = random.Random(1)


def _add(eng, tenant: str, prompt_len: int, max_tokens: int, kv_share: float | None):
    prompt = [_rng.randrange(5, 250) for _ in range(prompt_len)]
    return eng.add_request({"prompt_token_ids": prompt},
                           SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
                           tenant_id=tenant, kv_share=kv_share)


def _run(eng, reqs, each_step) -> None:
    for _ in range(5000):
        if not eng.has_unfinished():
            break
        eng.step()
        each_step()
    assert not eng.has_unfinished() and eng.pool.num_used == 0


@pytest.mark.parametrize("share", [0.25, None])
def test_a_tenant_holds_no_more_than_its_kv_quota_while_it_runs_two_or_more(llama_dir, share):
    eng = _engine(llama_dir, "fair", max_num_seqs=8, kv_cache_memory="64 blocks")
    big = [_add(eng, "big", 40, 40, share) for _ in range(8)]  # 10 blocks each when done
    small = [_add(eng, "small", 8, 8, None) for _ in range(4)]
    peak = {"blocks": 0, "running": 0}

    def each_step():
        mine = [r for r in eng.scheduler.running if tenant_of(r) == "big"]
        if len(mine) > 1:
            peak["blocks"] = max(peak["blocks"], sum(len(r.blocks) for r in mine))
        peak["running"] = max(peak["running"], len(mine))

    _run(eng, big + small, each_step)
    assert all(r.num_output_tokens == r.max_tokens for r in big + small)
    if share is not None:
        assert 0 < peak["blocks"] <= 16  # a quarter of 64
        assert peak["running"] >= 2  # a quota bounds how many run at once, not whether several can
    else:
        assert peak["blocks"] > 16


def test_a_request_larger_than_its_tenants_quota_runs_alone(llama_dir):
    eng = _engine(llama_dir, "fair", max_num_seqs=8, kv_cache_memory="64 blocks")
    reqs = [_add(eng, "tiny", 40, 8, 0.05) for _ in range(3)]  # quota 3 blocks; each needs 6
    other = _add(eng, "other", 8, 4, None)
    seen = {"most": 0}

    def each_step():
        seen["most"] = max(seen["most"], sum(1 for r in eng.scheduler.running if r.tenant_id == "tiny"))

    _run(eng, reqs + [other], each_step)
    assert seen["most"] == 1
    assert all(r.num_output_tokens == 8 for r in reqs) and other.num_output_tokens == 4
    assert other.first_token_time < reqs[1].first_token_time  # the quota holds back only its tenant


def test_decoding_past_the_quota_preempts_the_tenants_latest_request_only(llama_dir):
    """Two requests fit the quota when admitted (3 + 3 blocks of 8), then each decodes into
    more blocks: the later one is preempted, the earlier runs on, and the other tenant, with no
    quota, is untouched; both finish in full."""
    eng = _engine(llama_dir, "fair", max_num_seqs=8, kv_cache_memory="64 blocks")
    first, second = (_add(eng, "q", 24, 30, 0.125) for _ in range(2))  # quota 8 blocks; 7 each when done
    bystander = _add(eng, "free", 24, 30, None)
    _run(eng, [first, second, bystander], lambda: None)
    assert second.num_preemptions > 0 and first.num_preemptions == 0 and bystander.num_preemptions == 0
    assert all(r.num_output_tokens == 30 for r in (first, second, bystander))


@pytest.mark.parametrize("share", [0, -0.5, 1.5, float("nan"), True, "0.5"])
def test_a_bad_kv_share_is_refused_by_name_and_changes_nothing(llama_dir, share):
    from tierlm.errors import InvalidRequestError
    eng = _engine(llama_dir, "fair")
    with pytest.raises(InvalidRequestError, match="kv_share must be a fraction"):
        _add(eng, "t", 8, 2, share)
    assert not eng.has_unfinished() and eng.pool.num_used == 0


def test_speculative_guesses_stay_within_the_tenants_kv_quota(llama_dir):
    """A guess's slot is held like any token's: guesses past the quota overshot it for the step
    they ran in (two requests that repeat themselves, quota 10 blocks of 8: one was 11)."""
    eng = _engine(llama_dir, "fair", max_num_seqs=8, kv_cache_memory="40 blocks",
                  speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    loop = [7, 8, 9, 10, 11]
    reqs = [eng.add_request({"prompt_token_ids": loop * k + [12 + k]},
                            SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                            tenant_id="q", kv_share=0.25) for k in (3, 4, 5)]
    over = []

    def each_step():
        mine = [r for r in eng.scheduler.running if tenant_of(r) == "q"]
        held = sum(len(r.blocks) for r in mine)
        if len(mine) > 1 and held > 10:
            over.append(held)

    _run(eng, reqs, each_step)
    assert not over
    assert all(r.num_output_tokens == 40 for r in reqs)
    assert eng.stats().spec_accepted_tokens > 0


def test_a_tenants_requests_with_different_shares_are_held_to_the_least_without_churn(llama_dir):
    """A request admitted by its own larger share was preempted at the next step by the running
    request's smaller one, then admitted again: 30 preemptions (and recomputes) for one request."""
    eng = _engine(llama_dir, "fair", max_num_seqs=8, kv_cache_memory="40 blocks")
    strict = _add(eng, "t", 30, 40, 0.1)  # quota 4 blocks: it runs alone past it
    loose = _add(eng, "t", 30, 40, 1.0)

    def each_step():
        assert sum(1 for r in eng.scheduler.running if r.tenant_id == "t") <= 1

    _run(eng, [strict, loose], each_step)
    assert strict.num_preemptions == 0 and loose.num_preemptions == 0
    assert strict.num_output_tokens == loose.num_output_tokens == 40


@pytest.mark.parametrize("share", [0.25, None])
def test_a_tenants_cache_partition_keeps_its_prefix_through_another_tenants_flood(llama_dir, share):
    """The peer is the same traffic without a partition: a flood of new prompts from another
    tenant, four times the pool, turns the cache over and takes the first tenant's prefix with it.
    With a `kv_cache_share`, the prefix is still on the device afterwards, and a hit on it gives
    the tokens a cold run gives."""
    eng = _engine(llama_dir, "fair", eviction_policy="lru")
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prefix = [_rng.randrange(5, 250) for _ in range(48)]  # 6 blocks of 8

    def gold(tail: list[int]):
        return eng.add_request({"prompt_token_ids": prefix + tail}, greedy, tenant_id="gold", cache_salt="g",
                               kv_cache_share=share)

    gold([1, 2, 3, 4])
    _run(eng, [], lambda: None)
    for _ in range(32):  # 32 x 8 blocks through a 64-block pool
        eng.add_request({"prompt_token_ids": [_rng.randrange(5, 250) for _ in range(60)]}, greedy,
                        tenant_id="flood", cache_salt="f")
    _run(eng, [], lambda: None)
    again = gold([9, 8, 7, 6])
    _run(eng, [], lambda: None)
    assert again.num_cached_tokens == (48 if share is not None else 0)
    fresh = _engine(llama_dir, "fair")
    cold = fresh.add_request({"prompt_token_ids": prefix + [9, 8, 7, 6]}, greedy)
    _run(fresh, [], lambda: None)
    assert cold.num_cached_tokens == 0 and again.output_token_ids == cold.output_token_ids


def test_a_partition_keeps_a_prefix_another_tenant_of_its_salt_cached_first(llama_dir):
    """Two tenants of one salt (the engine API) share cached prefixes: the one without a share
    sent the prompt first, so its blocks were ranked with the shared ones. The partitioned
    tenant's hit on them takes them into its partition, and they outlive the flood; before, the
    flood took them, and the blocks the tenant appended stayed in its partition, unreachable."""
    eng = _engine(llama_dir, "fair", eviction_policy="lru")
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prefix = [_rng.randrange(5, 250) for _ in range(48)]  # 6 blocks of 8

    def send(tenant: str, tail: list[int], share: float | None):
        req = eng.add_request({"prompt_token_ids": prefix + tail}, greedy, tenant_id=tenant, cache_salt="s",
                              kv_cache_share=share)
        _run(eng, [], lambda: None)
        return req

    send("silver", [1, 2, 3, 4], None)
    assert send("gold", [5, 6, 7, 8] * 3, 0.25).num_cached_tokens == 48
    for _ in range(32):  # 32 x 8 blocks through a 64-block pool
        eng.add_request({"prompt_token_ids": [_rng.randrange(5, 250) for _ in range(60)]}, greedy,
                        tenant_id="flood", cache_salt="f")
    _run(eng, [], lambda: None)
    _check_partitions(eng.pool)
    assert send("gold", [9, 8, 7, 6], 0.25).num_cached_tokens == 48


def test_partitions_share_one_policy_history_in_proportion_to_their_shares(llama_dir):
    """A learning policy (the default, duel) keeps up to `kv_policy_history` records, ~85 MiB
    once full by default. Each tenant's partition kept that many too: a tenants file giving a
    hundred tenants a share of 0.01 could hold ~8 GiB of history. A partition keeps its share of
    them (at least the floor of 1,024), so all partitions together keep about one pool's."""
    eng = _engine(llama_dir, "fair", eviction_policy="duel", kv_policy_history=8192)
    for tenant, share in (("a", 0.5), ("b", 0.01)):
        eng.add_request({"prompt_token_ids": [_rng.randrange(5, 250) for _ in range(20)]},
                        SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), tenant_id=tenant,
                        kv_cache_share=share)
    _run(eng, [], lambda: None)
    histories = {t: p.policy.history for t, p in eng.pool.partitions.items()}
    assert histories == {"a": 4096, "b": 1024} and eng.pool.policy.history == 8192


def test_a_bad_kv_cache_share_is_refused_by_name_and_changes_nothing(llama_dir):
    from tierlm.errors import InvalidRequestError
    eng = _engine(llama_dir, "fair")
    with pytest.raises(InvalidRequestError, match="kv_cache_share must be a fraction .* for no cache partition"):
        eng.add_request({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=1), kv_cache_share=1.5)
    assert not eng.has_unfinished() and eng.pool.num_used == 0 and eng.pool.partitions == {}


def _check_partitions(pool) -> None:
    """Every count the pool keeps for its partitions against the blocks themselves."""
    idle = [blk for blk in pool.cached.values() if blk.ref_cnt == 0]
    for key, part in pool.partitions.items():
        assert part.evictable == sum(blk.owner == key for blk in idle)
        assert len(part.policy) == sum(blk.owner == key for blk in pool.cached.values())
    assert len(pool.policy) == sum(blk.owner is None for blk in pool.cached.values())
    assert pool.num_free == len(pool._free) + len(idle)
    for blk in pool.cached.values():  # a chain goes tail first: no cached block outlives its parent
        assert blk.parent_hash is None or blk.parent_hash in pool.cached


def test_partitions_under_churn_keep_their_counts_and_change_no_output(llama_dir):
    """Tenants with and without partitions, shared prefixes, preemption (a pool too small for the
    batch) and aborts: the counts stay true at every step, nothing leaks, and every finished
    request's greedy tokens are those of the same prompt run alone."""
    rng = random.Random(7)
    eng = _engine(llama_dir, "fair", kv_cache_memory="20 blocks", max_num_seqs=6)
    tenants = {"a": 0.25, "b": 0.2, "c": None}
    prefixes = {t: [[rng.randrange(5, 250) for _ in range(rng.choice((8, 16, 24)))] for _ in range(3)]
                for t in tenants}
    reqs = []
    for i in range(36):
        t = rng.choice(list(tenants))
        prompt = rng.choice(prefixes[t]) + [rng.randrange(5, 250) for _ in range(rng.randrange(1, 12))]
        reqs.append(eng.add_request({"prompt_token_ids": prompt},
                                    SamplingParams(max_tokens=rng.randrange(1, 48), temperature=0, ignore_eos=True),
                                    tenant_id=t, cache_salt=t, kv_cache_share=tenants[t]))
    aborted = set(rng.sample(range(36), 4))
    for step in range(5000):
        if not eng.has_unfinished():
            break
        if step == 3:
            for i in aborted:
                eng.abort(reqs[i].request_id)
        eng.step()
        _check_partitions(eng.pool)
    assert not eng.has_unfinished() and eng.pool.num_used == 0
    assert eng.scheduler.num_preemptions > 0 and set(eng.pool.partitions) == {"a", "b"}
    assert sum(r.num_cached_tokens > 0 for r in reqs) > 5
    solo = _engine(llama_dir, "fair", enable_prefix_caching=False)
    for i, r in enumerate(reqs):
        if i in aborted:
            continue
        alone = solo.add_request({"prompt_token_ids": r.prompt_token_ids}, r.params)
        while solo.has_unfinished():
            solo.step()
        assert r.output_token_ids == alone.output_token_ids, i


@pytest.mark.parametrize("policy", ["lru", "chain"])
def test_partitions_of_tenants_sharing_prefixes_over_lower_tiers_keep_counts_and_chains(llama_dir, tmp_path, policy):
    """Tenants with and without shares (one changes its share midway) sharing a salt, so each
    hits and extends the others' chains, with host and disk tiers below (blocks demoted out of
    partitions and promoted into them), speculative decoding, offloads of the whole cache and
    preemption: the counts stay true and no cached block outlives its parent at every step (the
    flood took a head cached by a tenant without a share and left the rest of its chain in a
    partition), and every finished request's greedy tokens are those of its prompt alone."""
    rng = random.Random(0)
    eng = _engine(llama_dir, "fair", kv_cache_memory="20 blocks", max_num_seqs=4, max_model_len=160,
                  max_num_batched_tokens=40, eviction_policy=policy, kv_host_capacity="8 blocks",
                  kv_disk_dir=str(tmp_path), kv_disk_capacity="200 blocks",
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
    shares = {"a": 0.5, "b": 0.3, "c": None, "d": 0.2}
    prefixes = [[rng.randrange(5, 250) for _ in range(rng.randint(8, 60))] for _ in range(4)]
    reqs = []
    for step in range(4000):
        if step < 120 and rng.random() < 0.4:
            t = rng.choice(list(shares))
            if step == 60:
                shares["a"] = 0.1
            tail = [rng.randrange(5, 250) for _ in range(rng.randint(0, 20))]
            prompt = rng.choice(prefixes)[:rng.randint(1, 60)] + tail
            reqs.append(eng.add_request({"prompt_token_ids": prompt},
                                        SamplingParams(max_tokens=rng.randint(1, 16), temperature=0, ignore_eos=True),
                                        tenant_id=t, cache_salt="s", kv_cache_share=shares[t]))
        if rng.random() < 0.03:
            eng.offload_prefix_cache()
        eng.step()
        _check_partitions(eng.pool)
        if step >= 120 and not eng.has_unfinished():
            break
    assert not eng.has_unfinished() and eng.pool.num_used == 0
    assert eng.kv.stats.promoted_blocks > 0 and sum(r.num_cached_tokens > 0 for r in reqs) > 5
    solo = _engine(llama_dir, "fair", enable_prefix_caching=False, max_model_len=160)
    for r in reqs:
        alone = solo.add_request({"prompt_token_ids": r.prompt_token_ids}, r.params)
        while solo.has_unfinished():
            solo.step()
        assert r.output_token_ids == alone.output_token_ids


@pytest.mark.parametrize("share", [0.15, None])
def test_a_tenants_partition_of_the_host_tier_keeps_its_prefix_through_a_flood(llama_dir, share):
    """The tenant's share of the device (9 of 64 blocks) holds less than its 12-block prefix, so
    the rest goes down to the host tier. Another tenant's flood turns the device and the host
    tier over. Before, the host tier ranked every tenant's blocks together: the prefix's last 3
    blocks went with the flood, and a hit found 72 of its 96 tokens. With a `kv_cache_share`,
    the host tier keeps the tenant's blocks in a partition of its own (14 of 96 blocks), and a
    hit reads the whole prefix back: the tokens a cold run gives. Without one, nothing is left."""
    eng = _engine(llama_dir, "fair", eviction_policy="lru", kv_host_capacity="96 blocks", kv_tier_policy="lru")
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prefix = [_rng.randrange(5, 250) for _ in range(96)]  # 12 blocks of 8

    def gold(tail: list[int]):
        req = eng.add_request({"prompt_token_ids": prefix + tail}, greedy, tenant_id="gold", cache_salt="g",
                              kv_cache_share=share)
        _run(eng, [], lambda: None)
        return req

    gold([1, 2, 3, 4])
    for _ in range(48):  # 48 x 8 blocks: through the 64-block pool and the 96-block host tier, four times
        eng.add_request({"prompt_token_ids": [_rng.randrange(5, 250) for _ in range(60)]}, greedy,
                        tenant_id="flood", cache_salt="f")
    _run(eng, [], lambda: None)
    host = eng.kv.store.tiers[0]
    assert host.stats.evictions > 96  # (the flood did turn the host tier over)
    _check_tier_partitions(host)
    assert eng.stats().kv_host_partitions == ({"gold": {"blocks": 3, "capacity": 14}} if share is not None else None)
    again = gold([9, 8, 7, 6])
    assert again.num_cached_tokens == (96 if share is not None else 0)
    fresh = _engine(llama_dir, "fair")
    cold = fresh.add_request({"prompt_token_ids": prefix + [9, 8, 7, 6]}, greedy)
    _run(fresh, [], lambda: None)
    assert again.output_token_ids == cold.output_token_ids


def _check_tier_partitions(tier) -> None:
    """A tier's partition counts and policies against the blocks it holds."""
    for key, part in tier.partitions.items():
        owned = [h for h, owner in tier.owners.items() if owner == key]
        assert part.evictable == len(owned) == len(part.policy) and all(h in part.policy for h in owned)
    assert len(tier.policy) == len(tier.parents) - len(tier.owners)
    assert all(h in tier.parents for h in tier.owners)
