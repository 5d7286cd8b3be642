"""Fair shares above the connection: tenant -> user -> connection -> topic (docs/architecture.md, "The
hierarchical cycle"). Pure bookkeeping, no clock: the engine's cycle asks it whom to serve and charges it.

* Tenants are served by start-time fair queuing: each carries a tag, the cost it was served divided by its
  weight, across cycles. In a cycle a tenant may spend up to `(V + window - tag) x weight`, V being the lowest
  tag among the active tenants and the window `cycle_target_cost / sum of their weights`. A cycle's length is
  elastic (every ready client gets one batch), so a per-cycle quantum would give the wrong shares: the tags
  do not. A tenant that becomes active starts at `max(its tag, V)`: no credit for time spent idle.
* Users get deficit round robin, `quantum x weight` a cycle: while others wait, a user with 20 tabs gets
  about one frame a cycle, as a user with one. A second pass serves the clients passed over, uncharged, only
  when nobody served in the first pass waits for the next cycle without also having clients passed over.
* A cost is `bytes + frame_cost x frames`: on the measured hosts a frame costs as much as ~8 KiB
  (`fanout-loadtest calibrate`), so counting entries or bytes alone would favour the wrong side.

Each tenant keeps its ready clients in a deque (a client's `in_line` flag coalesces; entries of clients that
stopped being ready are dropped when reached): a dict per user cost 1.4-1.8x the flat cycle in the design's
prototype, a deque costs about what it does."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Hashable

if TYPE_CHECKING:
    from .client import Client

#: what a frame costs besides its bytes, in bytes (`fairness.frame_cost_bytes`)
FRAME_COST = 8192
#: the user quantum's part besides one frame: about one small frame a cycle
QUANTUM_EXTRA = 1024
#: a cycle's target cost across tenants (`fairness.cycle_target_ms` converted by the driver)
CYCLE_TARGET_COST = 4 * 1024 * 1024


class User:
    """One user of a tenant: an accounting object only (its clients are in the tenant's deque)."""

    __slots__ = ("key", "weight", "deficit", "stamp", "clients", "passed")

    def __init__(self, key: Hashable, weight: float) -> None:
        self.key = key
        self.weight = weight
        #: cost it may still be served this cycle (negative: a debt the next cycles pay back)
        self.deficit = 0.0
        #: the cycle its deficit was last refilled in
        self.stamp = -1
        #: its connected clients: the user is forgotten with its last
        self.clients = 0
        #: a client of it was passed over this cycle
        self.passed = False


class Tenant:
    """One tenant: its weight, tag, ready clients and what it was served."""

    __slots__ = ("name", "weight", "tag", "ready", "active", "users", "clients", "cost", "bytes", "frames", "entries")

    def __init__(self, name: str, weight: float) -> None:
        self.name = name
        self.weight = weight
        #: cost served / weight, carried across cycles (SFQ's start tag)
        self.tag = 0.0
        #: ready clients in order; a client is in it at most once (`Client.in_line`)
        self.ready: deque[Client] = deque()
        #: in the fair share's active tenants
        self.active = False
        self.users: dict[Hashable, User] = {}
        #: connected clients
        self.clients = 0
        #: served, since it was made: cost units, bytes, frames and entries
        self.cost = 0
        self.bytes = 0
        self.frames = 0
        self.entries = 0


class FairShare:
    """The tenants and users of one engine (`Engine.enable_fairness`)."""

    def __init__(self, *, frame_cost: int = FRAME_COST, quantum: int = 0, cycle_target_cost: int = CYCLE_TARGET_COST) -> None:
        if frame_cost < 0 or cycle_target_cost <= 0 or quantum < 0:
            raise ValueError("frame_cost and quantum must be >= 0 and cycle_target_cost > 0")
        self.frame_cost = frame_cost
        #: a user's refill a cycle at weight 1
        self.quantum = quantum or frame_cost + QUANTUM_EXTRA
        self.cycle_target_cost = cycle_target_cost
        self.tenants: dict[str, Tenant] = {}
        #: tenants with ready clients, in service order ...
        self.active: dict[Tenant, None] = {}
        #: ... and those that became active since the last cycle: served first ("sparse first")
        self.woken: list[Tenant] = []
        #: the virtual time: the lowest tag of the last cycle's active tenants (it never goes back)
        self.vtime = 0.0
        self.cycle = 0

    def tenant(self, name: str) -> Tenant:
        """The tenant `name`, made with weight 1 on first use."""
        tenant = self.tenants.get(name)
        if tenant is None:
            tenant = self.tenants[name] = Tenant(name, 1.0)
        return tenant

    def set_weight(self, name: str, weight: float) -> None:
        if not weight > 0:
            raise ValueError(f"tenant {name!r}: a weight must be > 0, not {weight!r}")
        self.tenant(name).weight = weight

    def join(self, client: Client, tenant_name: str, user_key: Hashable, user_weight: float = 1.0) -> None:
        """`client` belongs to `user_key` of `tenant_name` (the same key in two tenants is two users)."""
        tenant = self.tenant(tenant_name)
        user = tenant.users.get(user_key)
        if user is None:
            user = tenant.users[user_key] = User(user_key, user_weight)
        user.clients += 1
        tenant.clients += 1
        client.tenant = tenant
        client.user = user

    def leave(self, client: Client) -> None:
        """`client` disconnected: its user goes with its last client (an entry left in the tenant's deque is
        dropped when reached: the client is no longer ready)."""
        tenant, user = client.tenant, client.user
        if tenant is None or user is None:
            return
        tenant.clients -= 1
        user.clients -= 1
        if user.clients == 0:
            del tenant.users[user.key]
        client.tenant = None
        client.user = None

    def enqueue(self, client: Client) -> None:
        """`client` is ready with work: to the back of its tenant's deque (once), the tenant active."""
        if client.in_line:
            return
        tenant = client.tenant
        if tenant is None:
            return
        client.in_line = True
        tenant.ready.append(client)
        if not tenant.active:
            tenant.active = True
            if tenant.tag < self.vtime:
                tenant.tag = self.vtime
            self.woken.append(tenant)

    def order(self) -> list[Tenant]:
        """This cycle's tenants: those just woken first, then the others in their order."""
        woken = self.woken
        if woken:
            self.woken = []
            for tenant in woken:
                self.active.pop(tenant, None)
            order = woken + list(self.active)
            for tenant in woken:
                self.active[tenant] = None
            return order
        return list(self.active)

    def rest(self, tenant: Tenant) -> None:
        """`tenant` has no ready client left: out of the active set (its tag stays)."""
        tenant.active = False
        self.active.pop(tenant, None)

    def requeue(self, tenant: Tenant) -> None:
        """`tenant` still has ready clients: to the back of the service order."""
        self.active.pop(tenant, None)
        self.active[tenant] = None
