"""One connection of Centrifugo's client protocol v2 (docs/centrifugo.md, "Client protocol"): its commands,
run strictly in the order sent, on our machinery.

No session exists before the `connect` command, which carries the token: it opens one as every transport
does (`ClientSession.begin`: the bounds, the token, the connect hook, revocations, the per-user limit), and
its reply is written before anything else of the connection. Any other command first is a bad request
(close 3501). Once connected, each command is decoded into one of ours, the same typed commands as our JSON
protocol's (gateway/client_protocol.py; a subscribe is a `Subscribing`, with its join/leave choice), run by
gateway/commands.py `run` (its checks, limits and hooks) with the command's id as request id; how to answer
it (the method, the subscribe's flags) goes in the connection's table (`answers`), which the framer
(gateway/centrifugo/client_frames.py) takes from. `connect`, `history` and `sub_refresh` are this module's own
verbs over the session; `history` is answered in the codec's form through the same direct queue, so every
answer keeps its place among the data.

Recovery is decided before the subscribe, from the ring as it is then: complete (same epoch, nothing after
the client's offset left the ring or given up) -> subscribe from the offset, `recovered: true`, the missed
publications pushed right after the reply; else -> from the end, `recovered: false`, none. The connect
hook's server-side subscriptions recover the same way, from the positions of `connect` `subs`
(gateway/centrifugo/server_subs.py). A subscription gets join/leave pushes only when its subscribe asked
(`join_leave`): the others decline them in the presence tracker, where they are queued (gateway/commands.py).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Protocol

from core import TopicKind
from core.config import MAX_SEQ
from core.errors import RequestError

from .. import commands, schema
from ..client_protocol import Decoded, Subscribing, decode_value
from ..errors import TokenExpired
from ..session import ClientSession, LateRefused
from . import client_codes as codes
from .api_errors import ApiError
from .client_codec import BadFrame, Codec
from .client_frames import READY, Answer, Answers, error_reply, expiry
from .history import HistoryBudget, HistoryQuery, HistoryRead, position_only
from .server_subs import Position, asked_positions, complete_since, subscribe_server_side

if TYPE_CHECKING:
    from ..scheduler import Connection
    from ..session_services import SessionServices

log = logging.getLogger("gateway.centrifugo")

#: the server's name in connect replies
VERSION = "fanout-gateway"
#: the largest command id (uint32)
MAX_ID = (1 << 32) - 1
#: subscribe `flag` bit: answer error 112 rather than `recovered: false`
REJECT_UNRECOVERED = 2
#: what a history answer leaves of the client's direct-queue room: its own bytes besides the publications
#: (id, offset, epoch, framing) and the smaller replies after it (a 111 for each history it could not hold);
#: each publication costs its data and ~32 bytes more (`{"data":...,"offset":N}`)
HISTORY_RESERVE_BYTES = 16 << 10
HISTORY_ROW_BYTES = 40
#: publications a step of a history answer reads (~0.3 ms): a whole answer of 10,000 takes 10 steps
HISTORY_STEP = 1000
#: commands of a connection run and not answered yet (their answers queued behind its unread data, or
#: awaiting a hook or the broker): past it a command is refused with 111
MAX_ANSWERS = 16384
#: the close reason of a `send` (asynchronous messages have no equivalent here; an rpc is answered)
SEND_REFUSAL = "`send` is not available here: use rpc"


class Link(Protocol):
    """What a session needs of its WebSocket (gateway/transports/ws_centrifugo.py)."""

    @property
    def peer(self) -> tuple[str, int] | None: ...

    @property
    def closed(self) -> bool: ...

    def header_values(self, name: str) -> list[str]: ...

    def write_replies(self, reply: bytes) -> None:
        """Write one reply (encoded by the codec) in a frame of its own, at once, ahead of anything queued."""

    def close(self, code: int, reason: str) -> None:
        """Close with a Centrifugo code."""

    def pause(self) -> None:
        """Read nothing and run no command (the connect hook is asked)."""

    def resume(self) -> None:
        """Read again, and run the commands waiting (`CentrifugoSession.step`) in the next input turn."""

    def connection(self, session: ClientSession) -> Connection: ...

    def connected(self) -> None:
        """The session is open: pings start."""

    def pong(self) -> None: ...


class CentrifugoSession:
    """A connection's commands (module docstring)."""

    __slots__ = ("services", "codec", "link", "session", "queue", "waiting", "reading", "max_commands", "answers")

    def __init__(self, services: SessionServices, codec: Codec, link: Link) -> None:
        self.services = services
        self.codec = codec
        self.link = link
        self.session: ClientSession | None = None
        #: commands not run yet: the rest of a frame while the connect hook is awaited
        self.queue: deque[dict[str, Any]] = deque()
        self.waiting = False
        #: the history answer being read, a slice a step (its command id), else None: the commands after it wait
        self.reading: tuple[int, HistoryRead] | None = None
        #: commands one frame may hold: a reconnecting SDK sends connect and every subscribe at once
        self.max_commands = max(schema.MAX_COMMANDS_PER_FRAME, services.config.scheduler.max_subscriptions + 2)
        #: how to answer each command run and not answered yet, by its id (gateway/centrifugo/client_frames.py
        #: takes each as it converts the answer), at most `MAX_ANSWERS`
        self.answers: Answers = {}

    # -- input ---------------------------------------------------------------------------------------------

    def received(self, payload: bytes, text: bool) -> None:
        """One frame of the client: its commands are queued, and run one a step by `step`. A failure is our
        bug, not the peer's: this client is closed (3004)."""
        try:
            self._received(payload, text)
        except Exception:
            self._failed()

    @property
    def busy(self) -> bool:
        """Commands wait: for the connect hook's answer (`waiting`), or for their steps."""
        return self.waiting or self.reading is not None or bool(self.queue)

    def step(self) -> None:
        """Run the next command: one step of the connection's input turn (gateway/transports/ws_turns.py), so
        a frame of 1,002 commands takes turns among the other clients' work, as a `/ws` connection's input does."""
        try:
            if self.waiting or self.link.closed:
                return
            if self.reading is not None:
                self._read_history()
            elif self.queue:
                self._command(self.queue.popleft())
        except Exception:
            self._failed()

    def _failed(self) -> None:
        log.exception("centrifugo client %s: a command failed", self._client_id())
        self._drop_commands()
        self.link.close(codes.INTERNAL_CLOSE, "internal error")

    def _drop_commands(self) -> None:
        """The connection is closed: nothing more of it runs."""
        self.queue.clear()
        self.reading = None

    def _client_id(self) -> str:
        return "(connecting)" if self.session is None else self.session.identity.client_id

    def _received(self, payload: bytes, text: bool) -> None:
        try:
            got = self.codec.decode(payload, text)
        except BadFrame as exc:
            self._bad(str(exc))
            return
        if len(got) > self.max_commands:
            self._bad(f"more than {self.max_commands} commands in one frame")
            return
        self.queue.extend(got)

    def _bad(self, why: str) -> None:
        self.services.bad_input("centrifugo", "bad request: %s", why)
        self._drop_commands()
        self.link.close(codes.BAD_REQUEST_CLOSE, codes.close_reason(f"bad request: {why}"))

    def _command(self, command: dict[str, Any]) -> None:
        command_id = command.get("id", 0)
        if type(command_id) is not int or not 0 <= command_id <= MAX_ID:
            self._bad("`id` must be an integer in [0, 2**32)")
            return
        methods = [key for key in command if key != "id"]
        if not methods:
            if command_id:
                self._reply(error_reply(command_id, codes.BAD_REQUEST, "a command names one method"))
            elif self.session is not None:
                self.link.pong()
            else:
                self._bad("connect first")
            return
        if len(methods) > 1:
            self._bad(f"one method per command, not {len(methods)}")
            return
        method, params = methods[0], command[methods[0]]
        if not isinstance(params, dict):
            self._bad(f"`{method[:32]}` takes an object")
            return
        if self.session is None:
            if method == "connect" and command_id:
                self._connect(command_id, params)
            else:
                self._bad("connect first")
            return
        if method == "connect":
            self._bad("already connected")
        elif method == "send":
            self.link.close(codes.NOT_AVAILABLE_CLOSE, SEND_REFUSAL)
        elif not command_id:
            self._bad(f"`{method[:32]}` without an id")
        else:
            self._connected_command(self.session, command_id, method, params)

    def _reply(self, reply: dict[str, Any]) -> None:
        """An answer through the client's direct queue (ordered with its data), in the codec's form."""
        session = self.session
        if session is None:
            self.link.write_replies(self.codec.encode(reply))
            return
        self._queue_ready(self.codec.encode(reply))

    # -- connect -------------------------------------------------------------------------------------------

    def _connect(self, command_id: int, params: dict[str, Any]) -> None:
        token = params.get("token") or None
        if token is not None and not isinstance(token, str):
            self._bad("`token` is a string")
            return
        try:
            asked = asked_positions(params.get("subs"))
        except ValueError as exc:
            self._bad(str(exc))
            return
        try:
            session = ClientSession.begin(self.services, "centrifugo", self.link.peer, token=token)
        except TokenExpired as exc:  # the SDK asks its app for a fresh token (getToken), else gives up
            self._reply(error_reply(command_id, codes.TOKEN_EXPIRED, exc.message))
            return
        except RequestError as exc:
            self._refused(exc)
            return
        if session.awaits_hook:
            self.waiting = True
            self.link.pause()
            session.spawn(self._connect_via_backend(command_id, session, asked))
            return
        self._open(command_id, session, asked)

    async def _connect_via_backend(self, command_id: int, session: ClientSession, asked: dict[str, Position]) -> None:
        try:
            await session.pass_backend(self.link.header_values)
        except RequestError as exc:
            if not self.link.closed:
                self._refused(exc)
            return
        if self.link.closed:
            session.gone()
            return
        self.waiting = False
        self._open(command_id, session, asked)
        self.link.resume()  # the commands after the connect run in the link's next input turn

    def _refused(self, exc: RequestError) -> None:
        code = codes.close_code(exc.close_code or codes.BAD_REQUEST_CLOSE)
        self._drop_commands()
        self.link.close(code, codes.close_reason(exc.message))

    def _open(self, command_id: int, session: ClientSession, asked: dict[str, Position]) -> None:
        identity = session.identity
        # the hook's server-side subscriptions are made here, with the recovery `subs` asks for, not by the
        # registry (gateway/centrifugo/server_subs.py)
        server_side, session.state.granted = session.state.granted, ()
        try:
            session.open(self.link.connection(session))
        except LateRefused as late:
            self._refused(late)
            return
        self.session = session
        subs = subscribe_server_side(session, server_side, asked)
        ping = self.services.config.centrifugo.ping_interval_s
        result: dict[str, Any] = {"client": identity.client_id, "version": VERSION, "ping": max(1, round(ping)), "pong": True}
        if identity.principal is not None:
            result.update(expiry(identity.principal.expires_at))
        if subs:
            result["subs"] = subs
        # written now, in the step that registered the client: before any entry the scheduler writes
        self.link.write_replies(self.codec.encode({"id": command_id, "connect": result}))
        self.link.connected()

    # -- once connected --------------------------------------------------------------------------------------

    def _connected_command(self, session: ClientSession, command_id: int, method: str, params: dict[str, Any]) -> None:
        channel = params.get("channel")
        if method in ("subscribe", "unsubscribe", "publish", "presence", "presence_stats", "history") and (
            not isinstance(channel, str) or not channel
        ):
            if method == "unsubscribe":  # an unsubscribe that errors makes the SDKs reconnect
                self._reply({"id": command_id, "unsubscribe": {}})
            else:
                self._reply(error_reply(command_id, codes.BAD_REQUEST, "`channel` is a non-empty string"))
            return
        try:
            self._run(session, command_id, method, params, channel)
        except ValueError as exc:
            self._reply(error_reply(command_id, codes.BAD_REQUEST, str(exc)))

    def _run(self, session: ClientSession, command_id: int, method: str, params: dict[str, Any], channel: Any) -> None:
        ours: dict[str, Any]
        if method == "subscribe":
            self._subscribe(session, command_id, params, channel)
            return
        if method == "history":
            self._history(session, command_id, params, channel)
            return
        answer = method
        if method == "unsubscribe":
            ours, answer = {"op": "unsubscribe", "topic": channel}, "unsub"
        elif method == "publish":
            if "data" not in params:
                raise ValueError("`data` is required")
            ours, answer = {"op": "publish", "topic": channel, "data": self.codec.data(params["data"])}, "pub"
        elif method in ("presence", "presence_stats"):
            ours, answer = {"op": method, "topic": channel}, "presence" if method == "presence" else "stats"
        elif method == "rpc":
            ours = {"op": "rpc", "method": params.get("method", ""), "params": self.codec.data(params.get("data"))}
        elif method == "refresh":
            ours = {"op": "auth", "token": params.get("token")}
        elif method in ("sub_refresh", "ping"):
            self._reply({"id": command_id, method: {}})
            return
        else:
            self._reply(error_reply(command_id, codes.METHOD_NOT_FOUND, f"no method {method[:32]!r}"))
            return
        # an unsubscribe is answered {} whatever happens, so it must happen: not within the subscribe rate
        self._send(session, command_id, (answer, ""), decode_value({**ours, "id": command_id}), sent=method != "unsubscribe")

    def _send(self, session: ClientSession, command_id: int, answer: Answer, command: Decoded, *, sent: bool) -> None:
        """Run one of our commands for the client's command `command_id`, remembering how to answer it (the
        framer takes `answer` from the table as it converts the entry that answers it)."""
        if len(self.answers) >= MAX_ANSWERS and command_id not in self.answers:
            self._reply(
                error_reply(
                    command_id, codes.TOO_MANY_REQUESTS, f"{MAX_ANSWERS} commands of this connection are not answered yet"
                )
            )
            return
        self.answers[command_id] = answer
        commands.run_decoded(session, command, sent=sent)

    def _subscribe(self, session: ClientSession, command_id: int, params: dict[str, Any], channel: str) -> None:
        if params.get("tf"):
            raise ValueError("publication filters (`tf`) are not supported")
        config = self.services.topics.topic_config(channel)
        ring = config is not None and config.kind is TopicKind.RING
        flags = ""
        if ring and (params.get("recoverable") or params.get("recover")):
            flags += "k"
        if config is not None and config.kind is not TopicKind.PRIVATE and params.get("positioned"):
            flags += "p"
        ours: dict[str, Any] = {"op": "subscribe", "topic": channel, "id": command_id}
        if "data" in params:  # for the subscribe hook (docs/integration.md)
            ours["data"] = self.codec.data(params["data"])
        if ring and params.get("recover"):
            offset, epoch = params.get("offset", 0), params.get("epoch", "")
            if type(offset) is not int or not 0 <= offset < MAX_SEQ or not isinstance(epoch, str):
                raise ValueError("`offset` is an integer in [0, 2**53), `epoch` a string")
            flags += "w"
            if complete_since(self.services.topics, channel, offset, epoch):
                flags += "r"
                ours["since"] = {"epoch": epoch, "seq": offset}
            elif isinstance(params.get("flag"), int) and params["flag"] & REJECT_UNRECOVERED:
                self._reply(error_reply(command_id, codes.UNRECOVERABLE_POSITION, "unrecoverable position"))
                return
        command = decode_value(ours)
        if isinstance(command, schema.Subscribe):  # the same command as ours, with the join/leave choice
            command = Subscribing(
                topic=command.topic,
                since=command.since,
                data=command.data,
                id=command.id,
                join_leave=bool(params.get("join_leave")),
            )
        self._send(session, command_id, ("sub", flags), command, sent=True)

    def _history(self, session: ClientSession, command_id: int, params: dict[str, Any], channel: str) -> None:
        identity = session.identity
        session.state.last_command = time.monotonic()
        config = self.services.topics.topic_config(channel)
        if config is None:
            self._reply(error_reply(command_id, codes.UNKNOWN_CHANNEL, f"no channel {channel[:256]!r}"))
            return
        if identity.subscribe_refusal(channel, config) is not None:
            self._reply(error_reply(command_id, codes.PERMISSION_DENIED, "permission denied"))
            return
        query = _history_query(params)
        # the answer goes through the client's direct queue: never built larger than the room it has there
        room = self.services.clients.direct_room(identity.client_id) - HISTORY_RESERVE_BYTES
        if query.limit != 0 and room <= 0:
            self._reply(
                error_reply(
                    command_id, codes.TOO_MANY_REQUESTS, "the connection's replies are not read yet: ask again once they are"
                )
            )
            return
        try:
            query.check()
            topics = self.services.topics
            budget = HistoryBudget(size=room, row_cost=HISTORY_ROW_BYTES, first_always=False)
            reading = HistoryRead(topics.topic(channel), query, budget) if topics.has_topic(channel) else None
        except ApiError as exc:
            self._reply(error_reply(command_id, exc.code, exc.message))
            return
        if reading is None:
            self._queue_ready(self.codec.history(command_id, position_only(0, "")))
            return
        self.reading = (command_id, reading)
        self._read_history()

    def _read_history(self) -> None:
        """A slice of the history being read (`HISTORY_STEP`); once it is whole, its reply is queued."""
        assert self.reading is not None
        command_id, reading = self.reading
        if reading.step(HISTORY_STEP):
            self.reading = None
            self._queue_ready(self.codec.history(command_id, reading.answer))

    def _queue_ready(self, reply: bytes) -> None:
        """A reply in the codec's form through the client's direct queue."""
        session = self.session
        assert session is not None
        session.send(bytes((READY,)) + reply)


def _history_query(params: dict[str, Any]) -> HistoryQuery:
    limit, since, reverse = params.get("limit", 0), params.get("since"), params.get("reverse", False)
    if type(limit) is not int or not isinstance(reverse, bool):
        raise ValueError("`limit` is an integer, `reverse` a boolean")
    position = None
    if since is not None:
        if not isinstance(since, dict) or type(since.get("offset", 0)) is not int or not isinstance(since.get("epoch", ""), str):
            raise ValueError("`since` is {offset, epoch}")
        position = (since.get("offset", 0), since.get("epoch", ""))
    return HistoryQuery(limit, position, reverse)
