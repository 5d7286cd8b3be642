"""Both client protocols over one session seam (gateway/client_protocol.py, gateway/session.py): the same
subscribe with recovery, sent in our JSON protocol and in Centrifugo's, over a fake connection and the
session services of an in-process hub whose catalog records what reaches it, asks the catalog the same."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import orjson
import pytest

from gateway.catalog import TopicCatalog
from gateway.centrifugo.client_codec import JsonCodec
from gateway.centrifugo.client_session import CentrifugoSession
from gateway.config import load_config
from gateway.hub import Hub
from gateway.scheduler import Delivered
from gateway.session import ClientSession
from gateway.session_services import SessionServices
from gateway.testing import DEFAULTS

pytestmark = pytest.mark.unit

PEER = ("192.0.2.7", 4000)
TOPIC = "chat.seam"


class RecordingCatalog:
    """The hub's catalog, recording every subscribe and grant before it runs them."""

    def __init__(self, real: TopicCatalog) -> None:
        self.real = real
        self.asked: list[tuple[str, str, dict[str, Any]]] = []

    def check_room(self, client_id: str, topic: str) -> None:
        self.real.check_room(client_id, topic)

    def subscribe(self, client_id: str, topic: str, **asked: Any) -> None:
        self.asked.append(("subscribe", topic, asked))
        self.real.subscribe(client_id, topic, **asked)

    def grant(self, client_id: str, topic: str, **asked: Any) -> None:
        self.asked.append(("grant", topic, asked))
        self.real.grant(client_id, topic, **asked)


class FakeConnection:
    """The scheduler's side of a client, recording the frames it is given."""

    blocked_since: float | None = None

    def __init__(self, session: ClientSession) -> None:
        self.session = session
        self.identity = session.identity
        self.frames: list[bytes] = []
        self.kicked: tuple[int, str] | None = None

    def deliver(self, batch: Any, frame: bytes) -> Delivered:
        self.frames.append(frame)
        return Delivered.DONE

    def flush(self) -> bool:
        return True

    def kick(self, code: int, reason: str, retry_ms: int | None = None) -> None:
        self.kicked = (code, reason)

    def describe(self) -> dict[str, Any]:
        return {}


class FakeLink:
    """The Centrifugo session's WebSocket, recording the replies written ahead of the queue."""

    peer = PEER
    closed = False

    def __init__(self) -> None:
        self.replies: list[bytes] = []
        self.connection_made: FakeConnection | None = None

    def header_values(self, name: str) -> list[str]:
        return []

    def write_replies(self, reply: bytes) -> None:
        self.replies.append(reply)

    def close(self, code: int, reason: str) -> None:
        raise AssertionError(f"closed: {code} {reason}")

    def pause(self) -> None:
        raise AssertionError("no connect hook here")

    def resume(self) -> None:
        raise AssertionError("no connect hook here")

    def connection(self, session: ClientSession) -> FakeConnection:
        self.connection_made = FakeConnection(session)
        return self.connection_made

    def connected(self) -> None:
        pass

    def pong(self) -> None:
        pass


def services_recording(hub: Hub) -> tuple[SessionServices, RecordingCatalog]:
    real = hub.services
    catalog = RecordingCatalog(real.catalog)
    return SessionServices(
        config=real.config,
        clients=real.clients,
        catalog=cast(TopicCatalog, catalog),
        hooks=real.hooks,
        topics=real.topics,
        presence=real.presence,
        members=real.members,
        scheduler=real.scheduler,
        sessions=real.sessions,
        tracing=real.tracing,
        bad_input=real.bad_input,
        commands=real.commands,
    ), catalog


def test_a_subscribe_with_recovery_reaches_the_catalog_alike_through_both_protocols() -> None:
    async def run() -> None:
        hub = Hub(load_config(overrides=DEFAULTS, environ={}), instance_id="seam")
        for n in range(3):
            assert hub.catalog.publish_nowait(TOPIC, {"n": n}) is not None
        epoch = hub.topics.topic(TOPIC).epoch
        services, catalog = services_recording(hub)

        ours = ClientSession.begin(services, "ws", PEER)
        ours.open(FakeConnection(ours))
        command = {"op": "subscribe", "topic": TOPIC, "since": {"epoch": epoch, "seq": 1}, "id": 2}
        assert ours.handle(orjson.dumps(command)) == 1
        theirs_link = FakeLink()
        theirs = CentrifugoSession(services, JsonCodec(), theirs_link)
        theirs.received(
            b'{"id":1,"connect":{}}\n'
            + orjson.dumps({"id": 2, "subscribe": {"channel": TOPIC, "recover": True, "offset": 1, "epoch": epoch}}),
            True,
        )
        while theirs.busy:
            theirs.step()
        assert theirs.session is not None and theirs.session.live
        assert b'"connect"' in theirs_link.replies[0]
        assert theirs.answers == {2: ("sub", "kwr")}  # until the framer converts its `subscribed` entry

        (verb_ours, topic_ours, asked_ours), (verb_theirs, topic_theirs, asked_theirs) = catalog.asked
        assert (verb_ours, topic_ours) == (verb_theirs, topic_theirs) == ("subscribe", TOPIC)
        # the same command: Centrifugo's request id is its command's, how to answer it is in its table
        assert asked_ours == asked_theirs == {"since": (epoch, 1), "ack": False, "delta": None, "request_id": 2}
        # the engine holds both subscriptions from the same point: the two missed publications come next
        for session in (ours, theirs.session):
            assert TOPIC in session.client_state().subs
            assert session.connection is not None and cast(FakeConnection, session.connection).kicked is None
        await hub.stop()

    asyncio.run(run())
