"""fanout_client's recovery bookkeeping (fanout_client.events.Stream), fed entries directly: the same cases
as fanout.js's (tests/e2e/test_client_lib.py::test_recovery_is_exact_on_synthetic_entries)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from fanout_client.events import Loss, Message, Stream


def _seen(events: list) -> list:
    return [("msg", e.epoch, e.seq) if isinstance(e, Message) else ("loss", e.from_seq, e.to_seq, e.reason) for e in events]


def test_duplicates_dropped_losses_passed_on_holes_reported_epochs_restart() -> None:
    s = Stream("t")
    out = s.on_subscribed("ring", "e1", 3)
    for seq in (3, 4, 4, 3, 5):
        out += s.on_msg(seq, None)
    out += s.on_loss(6, 9, "lagged")
    out += s.on_msg(9, None) + s.on_msg(12, None)
    s.resubscribing()
    out += s.on_msg(14, None)  # an entry of the old subscription, before the answer: ignored
    out += s.on_subscribed("ring", "e1", 11)  # reconnect: replay from 11
    out += s.on_msg(11, None) + s.on_msg(12, None) + s.on_msg(13, None)
    out += s.on_loss(5, 10, "gone")  # a range already behind us
    s.resubscribing()
    out += s.on_subscribed("ring", "e2", 0)  # another epoch
    out += s.on_loss(14, None, "epoch") + s.on_msg(0, None)
    assert _seen(out) == [
        ("msg", "e1", 3),
        ("msg", "e1", 4),
        ("msg", "e1", 5),
        ("loss", 6, 9, "lagged"),
        ("msg", "e1", 9),
        ("loss", 10, 12, "gap"),
        ("msg", "e1", 12),
        ("msg", "e1", 13),
        ("loss", 14, None, "epoch"),
        ("msg", "e2", 0),
    ]
    assert out[-2] == Loss("t", 14, None, "epoch", "e2") and s.position is not None and s.position.seq == 1


def test_snapshot_jumps_are_conflation_and_private_takeovers_drop_redeliveries() -> None:
    snap = Stream("s")
    out = snap.on_subscribed("snapshot", "e1", 7) + snap.on_msg(7, "a") + snap.on_msg(20, "b") + snap.on_msg(19, "c")
    assert out == [Message("s", 7, "a", "e1"), Message("s", 20, "b", "e1")]
    priv = Stream("p")
    out = priv.on_subscribed("private", "e1", 0) + priv.on_msg(0, 0) + priv.on_msg(1, 1) + priv.on_msg(2, 2)
    priv.resubscribing()
    out += priv.on_subscribed("private", "e1", 1) + priv.on_msg(1, 1) + priv.on_msg(2, 2) + priv.on_msg(3, 3)
    priv.resubscribing()
    out += priv.on_subscribed("private", "e1", 0) + priv.on_msg(0, 0) + priv.on_msg(4, 4)
    priv.resubscribing()
    out += priv.on_subscribed("private", "e1", 9)  # taken over past ours: another connection committed 5..8
    priv.resubscribing()
    out += priv.on_subscribed("private", "e2", 0) + priv.on_msg(0, 0)  # a new queue, a new epoch
    assert [(type(e).__name__, e.seq if isinstance(e, Message) else (e.from_seq, e.to_seq, e.reason)) for e in out] == [
        ("Message", 0),
        ("Message", 1),
        ("Message", 2),
        ("Message", 3),
        ("Message", 4),
        ("Loss", (5, 9, "gone")),
        ("Message", 0),
    ]


def test_importing_the_ingest_client_loads_no_websocket_code() -> None:
    """Spark executors get fanout_client/__init__.py and ingest.py only (pipeline/spark.py)."""
    code = (
        "import sys, fanout_client.ingest, fanout_client\n"
        "assert not any(m.startswith(('websockets', 'fanout_client.client', 'fanout_client.events')) "
        "for m in sys.modules), sorted(sys.modules)\n"
        "assert fanout_client.Message.__name__ == 'Message' and callable(fanout_client.connect)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=30, cwd=Path(__file__).resolve().parents[2])
