"""Per-tenant KV quotas: how much of the device KV pool one tenant's running requests may hold.

Why: fair shares (fairness.py) divide the engine's steps, but a tenant with long contexts could
still fill the KV pool, and every other tenant's new request would then wait for room. A
request's `kv_share` (a fraction of the pool; the tenants file sets it per tier or tenant) caps
its tenant: a waiting request is admitted only if its tokens so far fit in what its tenant's
running requests leave of the quota, and when decoding pushes a tenant past its quota its latest
running request is preempted (recomputed later, as any preemption). A tenant may always run one
request, however large: a quota bounds how many run at once, never whether one can.

A running request counts the blocks it holds or will hold for the tokens it has (a prompt still
being prefilled in chunks counts whole), so requests admitted in consecutive steps cannot
together overshoot. Blocks shared between a tenant's requests (a common prefix) count once per
request: the quota is on what the requests reference, a safe over-estimate. Requests of one
tenant that carry different shares hold it to the least of them.
"""
from __future__ import annotations

from tierlm.engine.fairness import tenant_of
from tierlm.engine.request import Request


class KVQuotas:
    def __init__(self, block_size: int, num_blocks: int) -> None:
        self.block_size = block_size
        self.num_blocks = num_blocks

    def quota(self, req: Request) -> int | None:
        """`req`'s tenant's quota in blocks (None: no quota)."""
        if req.kv_share is None:
            return None
        return max(1, int(req.kv_share * self.num_blocks))

    def committed(self, req: Request) -> int:
        return max(len(req.blocks), -(-req.num_tokens // self.block_size))

    def held(self, mine: list[Request]) -> int:
        """Blocks committed to a tenant's running requests `mine`."""
        return sum(self.committed(r) for r in mine)

    def tenant_quota(self, reqs: list[Request]) -> int | None:
        """The quota of a tenant whose requests are `reqs`: the least any of them carries (None:
        none carries one). Why the least: admitting by a request's own, larger share while
        `over` held the tenant to a running one's smaller share preempted it at the next step,
        and admitted it again, step after step."""
        quotas = [q for q in map(self.quota, reqs) if q is not None]
        return min(quotas) if quotas else None

    def admits(self, req: Request, running: list[Request]) -> bool:
        """Whether `req` may start now: its tenant runs nothing, or its tokens fit in the rest."""
        tenant = tenant_of(req)
        mine = [r for r in running if tenant_of(r) == tenant]
        quota = self.tenant_quota([req, *mine])
        if quota is None or not mine:
            return True
        return self.held(mine) + self.committed(req) <= quota

    def groups(self, running: list[Request]) -> dict[str, list[Request]]:
        """Running requests by tenant, for the tenants some request of which carries a quota:
        built once a step, so that `draft_room` for each decode is not a scan of all of them."""
        by_tenant: dict[str, list[Request]] = {}
        for r in running:
            by_tenant.setdefault(tenant_of(r), []).append(r)
        return {t: mine for t, mine in by_tenant.items() if any(r.kv_share is not None for r in mine)}

    def draft_room(self, req: Request, mine: list[Request] | None) -> int | None:
        """Speculative guesses running `req` may take slots for without its tenant's running
        requests (`mine`, from `groups`; None: none carries a quota) holding more than its quota
        (None: no limit). Why: a guess's slot is held like any token's, and guesses past the
        quota overshot it for a whole step."""
        quota = None if mine is None else self.tenant_quota(mine)
        if quota is None or len(mine) < 2:
            return None  # no quota, or a lone request (which may outgrow it anyway)
        left = max(0, quota - self.held(mine))
        return max(0, (self.committed(req) + left) * self.block_size - req.num_tokens)

    def over(self, running: list[Request]) -> list[str]:
        """Tenants with a quota whose running requests (two or more) hold more than it allows."""
        return [t for t, mine in self.groups(running).items()
                if len(mine) > 1 and self.held(mine) > self.tenant_quota(mine)]
