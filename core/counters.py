"""Plain counters the gateway exports (Prometheus, /api/stats). Names follow docs/design/byte-ring.md §8 where they apply."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class Counters:
    messages_published: int = 0
    #: message entries handed to clients (ring, snapshot and private; direct snapshots included)
    messages_delivered: int = 0
    #: every entry handed to clients: messages, loss notices, replies, acks
    entries_emitted: int = 0
    bytes_emitted: int = 0
    direct_entries: int = 0
    loss_notices: int = 0
    #: seqs announced as lost by loss notices (sum of range lengths where known)
    messages_lost: int = 0
    holes_skipped: int = 0
    seqs_refused: int = 0
    back_pressure_events: int = 0
    cycles: int = 0
    clients_served: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
