"""Fair shares between tenants of one priority: virtual token counters.

Why: priority alone orders tiers, but within a tier first-come-first-served lets one tenant that
sends 100 requests at once make every other tenant of its tier wait behind all of them. Each
tenant here has a counter of the service it received (Sheng et al., "Fairness in Serving Large
Language Models", OSDI 2024: the virtual token counter): every token the engine computes for
it adds a cost, prompt tokens 1 and generated tokens 2 (a decode token costs the device about
as much as several prompt tokens; the paper's default weights). Among waiting requests of one
priority, the tenant with the smallest counter goes next, so tenants share the engine equally
however many requests each has queued; a tenant's own requests keep their arrival order. A
request's `tenant_weight` divides its cost: a tenant of weight 2 gets twice the share of one of
weight 1 (weighted fair queueing; a tenants file sets it per tier or tenant).

A tenant that returns after an idle spell does not bank credit: its counter is lifted to the
least counter among the tenants with work at its priority, so it is served next but cannot
then hold the engine for as long as it was away. When the engine runs out of work every
counter is dropped: shares are kept within a busy period, which also bounds the memory.
Requests without a tenant id share one anonymous tenant, so a single-tenant engine orders
its requests exactly as first-come-first-served.
"""
from __future__ import annotations

from collections import defaultdict
from typing import Callable, Iterator

from tierlm.engine.request import Request

PROMPT_COST = 1.0  # per prompt token computed (a cached prefix is not computed: no cost)
DECODE_COST = 2.0  # per generated token computed (a recompute after preemption counts as prompt)

SCHEDULING_POLICIES = ("fair", "fcfs")


def tenant_of(req: Request) -> str:
    """The tenant a request's service is counted for ("" for requests without one)."""
    return "" if req.tenant_id is None else req.tenant_id


class FairShare:
    """Per-tenant counters of service received, and the fair order of waiting requests."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}
        # (priority, tenant) → how many of its requests are waiting or running.
        self._active: dict[tuple[int, str], int] = defaultdict(int)

    def counter(self, req: Request) -> float:
        return self.counters.get(tenant_of(req), 0.0)

    def cost(self, req: Request, n: int) -> float:
        """What computing `n` more tokens of `req` costs its tenant (a weight-2 tenant pays half,
        and so gets twice the service of a weight-1 tenant for the same counter)."""
        prompt = max(0, min(n, req.num_prompt_tokens - req.num_computed_tokens))
        return (PROMPT_COST * prompt + DECODE_COST * (n - prompt)) / req.tenant_weight

    def arrive(self, req: Request) -> None:
        """A request joins the queues; a tenant with no other work at its priority is lifted."""
        key = (req.priority, tenant_of(req))
        if self._active[key] == 0:
            peers = [self.counters.get(t, 0.0) for (p, t), n in self._active.items()
                     if n and p == req.priority and t != key[1]]
            if peers:
                self.counters[key[1]] = max(self.counters.get(key[1], 0.0), min(peers))
        self._active[key] += 1

    def leave(self, req: Request) -> None:
        """A request left the queues (finished or aborted); the last one out drops every counter."""
        key = (req.priority, tenant_of(req))
        left = self._active.get(key, 0) - 1
        if left > 0:
            self._active[key] = left
        else:
            self._active.pop(key, None)
            if not self._active:
                self.counters.clear()

    def charge(self, costs: dict[str, float]) -> None:
        for tenant, c in costs.items():
            self.counters[tenant] = self.counters.get(tenant, 0.0) + c

    def victim_key(self, req: Request) -> tuple:
        """Preemption picks the largest: the lowest priority, then the most served tenant, then the
        latest arrival."""
        return (req.priority, self.counter(req), req.arrival_time, req.arrival_seq)

    def order(self, waiting: list[Request], pending: dict[str, float]) -> Iterator[Request]:
        """Waiting requests in fair order: best priority first; within it, the next request of the
        tenant whose counter plus `pending` (what this step already gives it, which the caller
        adds to as it admits) is least; ties go to the earlier arrival."""
        queues: dict[tuple[int, str], list[Request]] = defaultdict(list)
        for req in sorted(waiting, key=Request.sort_key):
            queues[(req.priority, tenant_of(req))].append(req)
        heads = {key: 0 for key in queues}

        def rank(key: tuple[int, str]) -> tuple:
            head = queues[key][heads[key]]
            return (key[0], self.counters.get(key[1], 0.0) + pending.get(key[1], 0.0),
                    head.arrival_time, head.arrival_seq)

        while heads:
            key = min(heads, key=rank)
            yield queues[key][heads[key]]
            heads[key] += 1
            if heads[key] == len(queues[key]):
                del heads[key]


def fcfs_order(waiting: list[Request], pending: dict[str, float]) -> Iterator[Request]:
    """First come, first served within a priority: the order before fair shares existed."""
    del pending
    yield from sorted(waiting, key=Request.sort_key)


OrderFn = Callable[[list[Request], dict[str, float]], Iterator[Request]]
