"""Continuous batching with chunked prefill and preemption by recompute.

Each step is a mapping request -> number of new tokens to compute (vLLM v1's idea): a decode
is 1, a prefill chunk is many, a prefix-cache hit just starts later. Budget order: running
decodes, then running prefill chunks, then waiting requests, until the token budget or the
sequence cap is spent. When KV blocks run out, the lowest-priority, latest-arrived running
request is preempted (blocks freed, recomputed later), so the engine never deadlocks.

Within one priority the "fair" policy (the default) shares the engine equally between tenants
(fairness.py): waiting requests are admitted by the least-served tenant first, and preemption
takes from the most-served tenant first. "fcfs" keeps arrival order within a priority. A
request's `kv_share` caps how much of the KV pool its tenant's running requests hold (quotas.py).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tierlm.engine.fairness import SCHEDULING_POLICIES, FairShare, fcfs_order, tenant_of
from tierlm.engine.quotas import KVQuotas
from tierlm.engine.request import Request, RequestStatus
from tierlm.kv.manager import KVCacheManager

if TYPE_CHECKING:
    from tierlm.engine.speculative import NgramProposer


@dataclass
class SchedulerOutput:
    # Ordered: single-token entries (decodes) first, then multi-token ones: prefill chunks and
    # decodes with speculative guesses (past `num_tokens`: the guesses are `spec_token_ids`).
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # Nothing could run: this request's prefix is still being read (wait for it, briefly).
    reading: Request | None = None

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 policy: str = "fair", max_loras: int | None = None,
                 proposer: "NgramProposer | None" = None) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy {policy!r} is unknown; use one of {', '.join(SCHEDULING_POLICIES)}")
        self.kv = kv
        self.max_tokens = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.max_loras = max_loras  # distinct LoRA adapters among running requests (None: no limit)
        self.proposer = proposer  # speculative decoding's guesses for decodes (None: one token a step)
        self.policy = policy
        self.fair = FairShare()
        self.quotas = KVQuotas(kv.block_size, kv.pool.num_blocks)
        self._order = self.fair.order if policy == "fair" else fcfs_order
        self._victim_key = self.fair.victim_key if policy == "fair" else Request.sort_key
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.fair.arrive(req)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, req: Request) -> None:
        """Take a request out of the queues and free its blocks (finish or abort)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        else:  # not queued (removed before): nothing left to count
            self.kv.free(req)
            return
        self.fair.leave(req)
        self.kv.free(req)

    def _preempt(self, out: SchedulerOutput, victim: Request | None = None) -> Request:
        if victim is None:
            victim = max(self.running, key=self._victim_key)
        self.running.remove(victim)
        self.kv.free(victim)
        self.kv.prefetch(victim)  # what of its prefix moves down meanwhile is read back off the loop
        victim.status = RequestStatus.WAITING
        victim.num_computed_tokens = 0
        victim.spec_token_ids = []
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.append(victim)
        out.preempted.append(victim)
        return victim

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_tokens
        chosen: dict[Request, int] = {}
        # 0) a tenant that decoding took past its KV quota gives back its latest requests.
        for tenant in self.quotas.over(self.running):
            while tenant in self.quotas.over(self.running):
                self._preempt(out, max((r for r in self.running if tenant_of(r) == tenant), key=Request.sort_key))
        over_quota = set(out.preempted)
        # 1) running requests: decodes first, then unfinished prefills, in priority order.
        self.running.sort(key=Request.sort_key)
        order = sorted(self.running, key=lambda r: r.num_tokens - r.num_computed_tokens > 1)
        quota_groups = self.quotas.groups(self.running) if self.proposer is not None else {}
        for req in order:
            if req not in self.running or budget <= 0:
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if self._speculate(req, budget, quota_groups.get(tenant_of(req))):
                chosen[req] = 1 + len(req.spec_token_ids)
                budget -= chosen[req]
                continue
            while not self.kv.allocate(req, n):
                victim = self._preempt(out)
                budget += chosen.pop(victim, 0)
                if victim is req:
                    break
            if req in self.running:
                chosen[req] = n
                budget -= n
        # 2) waiting requests, best priority first, while budget and sequence slots remain. One
        #    whose prefix is still being read from disk/Redis is passed over, so that read never
        #    stalls a step, nor the requests behind it that need no read. When nothing at all can
        #    run, the step reports the first such read for the caller to wait on briefly (new
        #    arrivals and aborts are still taken between waits). Past the store's read timeout a
        #    request counts as ready, busy or not, and starts with what was read so far.
        # Fair order: each admission adds its cost to `pending`, so the next pick sees it.
        pending: dict[str, float] = {}
        for req, n in chosen.items():
            self._add_cost(pending, req, n)
        reading = None
        adapters = {r.lora for r in self.running if r.lora is not None}
        # Once a request waits for an adapter slot, those after it in order that use an adapter
        # wait too, even one already running: they would keep its slot busy, and a request of a
        # fifth adapter behind a stream of four busy ones would wait for ever. Base-model
        # requests, which take no slot, go on.
        slot_wanted = False
        for req in self._order(list(self.waiting), pending):
            if budget <= 0 or len(self.running) >= self.max_seqs:
                break
            if req in out.preempted:
                if req in over_quota:
                    continue  # (its tenant's quota, not the pool, was full: others may still fit)
                break  # do not re-admit what this step just evicted
            if not self.quotas.admits(req, self.running):
                continue  # its tenant's quota is full: others go ahead
            if req.lora is not None and self.max_loras is not None and (
                    slot_wanted or (req.lora not in adapters and len(adapters) >= self.max_loras)):
                slot_wanted = True
                continue  # every adapter slot is taken
            if not self.kv.prefix_ready(req) and not self.kv.read_overdue(req):
                if reading is None:
                    reading = req
                # One held for room keeps its place while it reads back what left the device
                # meanwhile: those behind it took that room (and more of its prefix) before.
                if self.kv.is_held(req):
                    break
                continue
            if not self._admit(req, budget, chosen):
                break
            if req.lora is not None:
                adapters.add(req.lora)
            budget -= chosen[req]
            self._add_cost(pending, req, chosen[req])
        if not chosen and reading is not None:
            out.reading = reading
        out.scheduled = sorted(chosen.items(), key=lambda kv: kv[1] > 1)
        if self.policy == "fair":
            self.fair.charge(pending)
        return out

    def _speculate(self, req: Request, budget: int, tenant_running: list[Request] | None) -> bool:
        """A decode with guesses at its next tokens (speculative.py): set them and their slots, if
        it may speculate, a guess is found and the budget, its tenant's KV quota (over
        `tenant_running`, its running requests when one carries a quota) and the pool have room
        for them (else it decodes one token, and a pool short of room preempts as for any
        decode)."""
        req.spec_token_ids = []
        if self.proposer is None or budget < 2 or req.num_tokens - req.num_computed_tokens != 1:
            return False
        if not self.proposer.guesses_at(len(self.running)):
            return False
        limit = min(self.proposer.room(req), budget - 1)
        quota_room = self.quotas.draft_room(req, tenant_running)
        drafts = self.proposer.propose(req, limit if quota_room is None else min(limit, quota_room))
        if not drafts or not self.kv.allocate(req, 1 + len(drafts)):
            return False
        req.spec_token_ids = drafts
        return True

    def _add_cost(self, pending: dict[str, float], req: Request, n: int) -> None:
        tenant = tenant_of(req)
        pending[tenant] = pending.get(tenant, 0.0) + self.fair.cost(req, n)

    def _admit(self, req: Request, budget: int, chosen: dict[Request, int]) -> bool:
        """Start `req` after its cached prefix, within `budget` tokens; False if there is no room."""
        hit = self.kv.find_cached_prefix(req)
        num_cached = hit.num_blocks * self.kv.block_size
        n = min(req.num_tokens - num_cached, budget)
        if not self.kv.allocate(req, n, hit):
            return False
        self.waiting.remove(req)
        req.num_computed_tokens = num_cached
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
            self.kv.count_lookup(req, num_cached)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        req.status = RequestStatus.RUNNING
        self.running.append(req)
        chosen[req] = n
        return True
