"""Tenants (`[fairness]`, docs/operations.md "Fair shares"): whose share a connection's service counts to.

A connection's tenant is, first that applies: the tenant whose `key_ids` hold the kid of the key that verified
its token (JWKS keys only: a key set chooses the key by kid, so a tenant with its own key cannot sign for
another), its token's `fairness.tenant_claim`, else `fairness.default_tenant`. A claim that names another
tenant than the key's is refused. Its user is its owner (the token's `sub`, or the connection itself while
anonymous). The engine does the sharing (core/fairness.py); this module decides the names and reports the
figures."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from core.fairness import FairShare, Tenant

from .errors import BadToken

if TYPE_CHECKING:
    from .auth.tokens import Principal
    from .config import FairnessConfig

#: cost units a millisecond of the cycle is worth: a frame (frame_cost_bytes, 8,192) took ~12 us of the
#: node's CPU on the measured hosts (docs/benchmarks.md), so ~680 KiB-equivalents a millisecond
COST_PER_MS = 8192 * 1000 // 12
#: the label of the tenants not configured in `/metrics` (a claim may name any number of them)
OTHER = "other"
#: tenants `GET /api/tenants` lists at most (by name)
MAX_LISTED = 1000


class Tenancy:
    def __init__(self, config: FairnessConfig) -> None:
        self.config = config
        self.enabled = config.enabled
        self.by_kid = {kid: tenant.name for tenant in config.tenants for kid in tenant.key_ids}
        self.configured = {tenant.name for tenant in config.tenants} | {config.default_tenant}

    def tenant_of(self, principal: Principal | None) -> str:
        """The tenant of a connection holding `principal` (None: anonymous). Raises BadToken when the token's
        claim names another tenant than its key."""
        if principal is None:
            return self.config.default_tenant
        keyed = self.by_kid.get(principal.key_id) if principal.key_id is not None else None
        claimed = principal.tenant
        if keyed is not None:
            if claimed is not None and claimed != keyed:
                raise BadToken(f"tenant mismatch: the token's key is tenant {keyed!r}'s, its claim says {claimed!r}")
            return keyed
        return claimed if claimed is not None else self.config.default_tenant

    def fair_share(self) -> FairShare:
        """The engine's tenants and users, weights as configured."""
        share = FairShare(
            frame_cost=self.config.frame_cost_bytes,
            cycle_target_cost=max(1, int(self.config.cycle_target_ms * COST_PER_MS)),
        )
        for tenant in self.config.tenants:
            share.set_weight(tenant.name, tenant.weight)
        return share

    def describe(self, share: FairShare | None) -> dict[str, Any]:
        """`GET /api/tenants`: this node's tenants, what each was served since the start, its share of the
        cost served against its weight's share among the tenants holding connections."""
        if share is None:
            return {"enabled": False, "tenants": []}
        tenants = sorted(share.tenants.values(), key=lambda t: t.name)
        total_cost = sum(t.cost for t in tenants) or 1
        weights = sum(t.weight for t in tenants if t.clients) or 1.0
        rows = [
            {
                "name": t.name,
                "weight": t.weight,
                "connections": t.clients,
                "users": len(t.users),
                "cost": t.cost,
                "bytes": t.bytes,
                "frames": t.frames,
                "messages": t.entries,
                "share": t.cost / total_cost,
                "weight_share": t.weight / weights if t.clients else 0.0,
                "backlogged": bool(t.ready),
            }
            for t in tenants[:MAX_LISTED]
        ]
        return {"enabled": True, "tenants": rows, "total": len(tenants), "truncated": len(tenants) > MAX_LISTED}

    def collect(self, share: FairShare | None) -> Iterator[Metric]:
        """Per tenant (those configured by name, the others summed as `other`): what it was served and holds."""
        if share is None:
            return
        by_label: dict[str, list[Tenant]] = {}
        for tenant in share.tenants.values():
            by_label.setdefault(tenant.name if tenant.name in self.configured else OTHER, []).append(tenant)
        for name, family_type, doc, figure in _FAMILIES:
            family = family_type(f"fanout_tenant_{name}", f"per tenant: {doc}", labels=["tenant"])
            for label, tenants in sorted(by_label.items()):
                family.add_metric([label], sum(figure(tenant) for tenant in tenants))
            yield family


#: the per-tenant families of /metrics: name, type, help, the figure of one tenant
_FAMILIES: tuple[tuple[str, type[CounterMetricFamily] | type[GaugeMetricFamily], str, Callable[[Tenant], float]], ...] = (
    ("cost", CounterMetricFamily, "cost units served (bytes + fairness.frame_cost_bytes per frame)", lambda t: t.cost),
    ("bytes", CounterMetricFamily, "bytes of entries served", lambda t: t.bytes),
    ("frames", CounterMetricFamily, "frames (batches) served", lambda t: t.frames),
    ("messages", CounterMetricFamily, "entries served", lambda t: t.entries),
    ("connections", GaugeMetricFamily, "connections", lambda t: t.clients),
    ("users", GaugeMetricFamily, "users with a connection", lambda t: len(t.users)),
    ("weight", GaugeMetricFamily, "weight", lambda t: t.weight),
)
