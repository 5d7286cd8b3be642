"""End to end: Spark feed -> a REAL gateway (gateway.testing.run_gateway) -> real WebSocket clients.

Every topic must reach every client complete and in seq order, in both publishing modes, with no loss entry
(the feed sends few enough rows per topic per micro-batch that any reorder window of 16 or more covers the
spread mode's reordering), and a partition sent twice must not be delivered twice.

Skipped until gateway/testing.py exists (it is written separately); meanwhile test_pipeline_feed.py covers
the sink against a test double of the ingest protocol.
"""

from __future__ import annotations

import contextlib
import time

import orjson
import pytest

from pipeline import ingest
from pipeline.feed import FeedOptions, run_feed

gateway_testing = pytest.importorskip(
    "gateway.testing", reason="gateway/testing.py (run_gateway) is not there yet: no real gateway to feed"
)
from websockets.sync.client import ClientConnection, connect  # noqa: E402

pytestmark = pytest.mark.spark

TOPICS = 3
#: 10 rows of each topic per micro-batch: the largest displacement spread mode can cause is below 10 seqs.
ROWS_PER_BATCH = 30
BATCHES = 3
SEQS = ROWS_PER_BATCH // TOPICS * BATCHES


class Subscriber:
    """A WebSocket client subscribed to some topics, keeping every entry it receives."""

    def __init__(self, ws, topics: list[str]) -> None:
        self.ws = ws
        self.entries: list[dict] = []
        self.start: dict[str, int] = {}
        for i, topic in enumerate(topics):
            self.ws.send(orjson.dumps({"op": "subscribe", "topic": topic, "id": i + 1}).decode())
        deadline = time.monotonic() + 10
        while len(self.start) < len(topics):
            self._receive(deadline)
        for entry in self.entries:
            if entry.get("type") == "error":
                raise AssertionError(f"subscribe failed: {entry}")

    def _receive(self, deadline: float) -> bool:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        try:
            batch = orjson.loads(self.ws.recv(timeout=remaining))
        except TimeoutError:
            return False
        assert isinstance(batch, list), f"server batches are JSON arrays, got {batch!r}"
        for entry in batch:
            self.entries.append(entry)
            if entry.get("type") == "subscribed":
                self.start[entry["topic"]] = entry["seq"]
        return True

    def seqs(self, topic: str) -> list[int]:
        return [e["seq"] for e in self.entries if e.get("type") == "msg" and e["topic"] == topic]

    def losses(self) -> list[dict]:
        return [e for e in self.entries if e.get("type") == "loss"]

    def wait_for(self, want: dict[str, int], timeout: float = 30) -> None:
        """Receive until every topic's last seq is ``want[topic]`` (or a loss, or the timeout)."""
        deadline = time.monotonic() + timeout
        while any((self.seqs(t) or [-1])[-1] < last for t, last in want.items()) and not self.losses():
            if not self._receive(deadline):
                break


def topics() -> list[str]:
    return [f"feed.rate-{t}" for t in range(TOPICS)]


def subscriber_socket(ws_url: str) -> ClientConnection:
    """A WebSocket connection whose reader never pauses for a full queue: closing it gets the server's close
    frame at once even when the test left messages unread (with the default high-water mark, 16 frames, the
    reader stops and the close waits out close_timeout, 10 s)."""
    return connect(ws_url, open_timeout=10, max_queue=None)


def subscribe(stack: contextlib.ExitStack, ws_url: str) -> Subscriber:
    return Subscriber(stack.enter_context(subscriber_socket(ws_url)), topics())


@pytest.mark.parametrize(
    "by_topic, lockstep", [(False, False), (False, True), (True, False)], ids=["spread", "lockstep", "by-topic"]
)
def test_feed_reaches_websocket_clients_in_order(spark, tmp_path, by_topic, lockstep):
    with gateway_testing.run_gateway() as gw, contextlib.ExitStack() as stack:
        clients = [subscribe(stack, gw.ws_url) for _ in range(2)]
        opts = FeedOptions(source="rate", rows_per_batch=ROWS_PER_BATCH, topics=TOPICS, num_partitions=2,
                           by_topic=by_topic, lockstep=lockstep, available_now=True, port=gw.ingest_port,
                           checkpoint=str(tmp_path / "ck"), timeout=20, admin_url=gw.http_url,
                           admin_token=gw.admin_token)  # fmt: skip
        for _ in range(BATCHES):
            stats = run_feed(spark, opts)
            assert stats.already_landed == 0
        for client in clients:
            client.wait_for({t: SEQS - 1 for t in topics()})
        for client in clients:
            assert client.losses() == [], "loss entries: the gateway's reorder window is too small?"
            for topic in topics():
                assert client.start[topic] == 0, f"{topic}: the client subscribed before the first publish"
                assert client.seqs(topic) == list(range(SEQS)), topic


def test_a_partition_sent_twice_is_delivered_once(tmp_path):
    partition = [(topic, seq, orjson.dumps({"seq": seq}).decode()) for seq in range(50) for topic in topics()]
    with gateway_testing.run_gateway() as gw, contextlib.ExitStack() as stack:
        client = subscribe(stack, gw.ws_url)
        first = ingest.publish(partition, port=gw.ingest_port, chunk_size=40)
        retry = ingest.publish(partition, port=gw.ingest_port, chunk_size=40)
        assert (first.accepted, first.refused) == (150, 0)
        assert (retry.accepted, retry.refused) == (0, 150)
        # one more record after the retry: it must come right after seq 49, with nothing in between
        ingest.publish([(topics()[0], 50, '"after"')], port=gw.ingest_port)
        client.wait_for({topics()[0]: 50, topics()[1]: 49, topics()[2]: 49})
        assert client.losses() == []
        assert client.seqs(topics()[0]) == list(range(51))
        for topic in topics()[1:]:
            assert client.seqs(topic) == list(range(50))
