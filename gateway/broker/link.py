"""This node's connections to Redis (docs/cluster.md §3, "Topologies"): the command client, the channel
connection in subscribe mode, losing Redis and reconnecting, resubscribing, and handing each channel message
to the broker. One implementation per topology behind one interface (`Link`):

* `SingleLink`: one Redis at `[broker] url`.
* `ClusterLink` (cluster_link.py): Redis Cluster at `[broker] cluster_addresses`, one channel connection
  per shard in sharded pub/sub.
* `SentinelLink`: the primary that the sentinels at `[broker] sentinel_addresses` name for `sentinel_master`
  (redis-py's Sentinel client asks them at every connect, so a reconnect after a failover finds the new
  primary). A failover is a Redis lost and back: the promoted replica may lack accepted writes, which the
  reconnect detects per topic before publishes resume (`LinkHooks.reconnected`, the rewind).

The channel connection's failure is the sign that Redis is gone: publishes are refused until the reader
has reconnected, resubscribed every channel and the broker has checked its topics (`LinkHooks`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import MasterNotFoundError, Sentinel
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisClusterException, RedisError

from core import RequestError

from ..config import BrokerConfig
from ..errors import BrokerUnavailable
from . import scripts
from .base import BrokerUnreachable

log = logging.getLogger("gateway.broker")

#: Pause between attempts to reach Redis (at start and after losing it).
RETRY_S = 0.5
#: A Redis command that takes longer than this counts as Redis lost (commands are O(1) or O(capacity)).
COMMAND_TIMEOUT_S = 5.0
#: The readiness probe (GET /readyz): a PING this often, which must answer within PROBE_TIMEOUT_S. A Redis
#: stopped (SIGSTOP, a frozen VM) sends no error and the channel connection waits forever: only asking tells.
#: Redis counts as not answering at most PROBE_PERIOD_S + PROBE_TIMEOUT_S after it stopped.
PROBE_PERIOD_S = 2.0
PROBE_TIMEOUT_S = 2.0
#: The broker's state lines (`SingleLink._health_changed`): one when /readyz turns `broker_unavailable`, one when
#: it is ready again, with the seconds it was not; never one per attempt. A Redis that flaps gets at most
#: STATE_LINES_BURST lines at once, then one per STATE_LINE_EVERY_S, which tells the state then and how many
#: changes it stands for.
STATE_LINES_BURST = 2
STATE_LINE_EVERY_S = 5.0
#: The failures that mean Redis is lost (or answered something this node cannot use); redis-py's cluster client
#: raises RedisClusterException (not a RedisError) when it cannot map a slot to a node, e.g. during a failover.
LINK_ERRORS = (RedisError, RedisClusterException, OSError, asyncio.TimeoutError, RequestError)


def redacted(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


def address(text: str) -> tuple[str, int]:
    """`"host:port"` as a pair (config.py checked the form)."""
    host, _, port = text.rpartition(":")
    return host.strip("[]"), int(port)


@dataclass(slots=True)
class LinkHooks:
    """What the link tells the broker."""

    #: a message of a subscribed channel (channel name, payload)
    message: Callable[[str, bytes], None]
    #: Redis was lost: every topic must be read again once it is back
    lost: Callable[[], None]
    #: every channel to subscribe again on a new connection
    channels: Callable[[], list[str]]
    #: after a reconnect, before publishes resume: check the topics against Redis (raises LINK_ERRORS)
    reconnected: Callable[[], Awaitable[None]]
    #: publishes resumed: resync what lives in Redis
    back: Callable[[], None]
    #: Redis Cluster: a channel followed its slot to another shard and is subscribed there again; what was
    #: published on it meanwhile is not on the channel (cluster_link.py)
    moved: Callable[[str], None] = lambda channel: None
    #: how many topics the node serves (the `back` line tells how many it resynchronises)
    served: Callable[[], int] = lambda: 0


class Link(Protocol):
    """The broker's view of its Redis, whatever the topology."""

    #: the command client (pipelines, scripts), and the loaded scripts' SHA-1s by name
    redis: aioredis.Redis
    shas: dict[str, str]
    #: whether Redis answers (publishes are refused with `broker_unavailable` while not), and why not
    available: bool
    last_error: str
    #: attempts to reconnect that failed (`/metrics`)
    reconnect_failures: int
    #: where Redis is, for messages (no password)
    target: str
    #: Redis Cluster: channels are shard channels (SSUBSCRIBE), scripts publish with SPUBLISH and touch one
    #: slot each (scripts.py); `publish_command` is what the nodes' own publishes use
    sharded: bool
    publish_command: str

    @property
    def healthy(self) -> bool:
        """Redis is connected and answered the readiness probe's last PING in time."""

    async def connect(self, timeout: float) -> None:
        """Connect, retrying for `timeout` seconds; `BrokerUnreachable` then."""

    def run(self) -> list[asyncio.Task[None]]:
        """Start the channel reader and the readiness probe."""

    async def close(self) -> None: ...

    def lost(self, exc: BaseException) -> None:
        """Redis failed a command: refuse publishes until the reader reconnects."""

    async def subscribe_channels(self, channels: list[str]) -> None:
        """SUBSCRIBE and wait until Redis confirms: from then on no message of these channels is missed."""

    def unsubscribe_channel(self, channel: str) -> None: ...


class SingleLink:
    """One Redis (`[broker] url`)."""

    sharded = False
    publish_command = "PUBLISH"

    def __init__(self, config: BrokerConfig, hooks: LinkHooks) -> None:
        self.hooks = hooks
        self.target = redacted(config.url)
        self.redis = self._client(config)
        self.shas: dict[str, str] = {}
        self.available = False
        self.last_error = "not connected yet"
        #: whether Redis answered the readiness probe's last PING in time (`_probe_loop`, `healthy`)
        self.answering = True
        self.reconnect_failures = 0
        self._pubsub: AbstractConnection | None = None
        self._subscribing: dict[str, asyncio.Future[None]] = {}
        #: when the last reconnect succeeded (monotonic): a probe's PING that began before it is stale
        self._reconnected_at = 0.0
        #: the state the lines told last (`_health_changed`), since when /readyz says broker_unavailable
        #: (monotonic; None while ready), why, and what the outage cost
        self._healthy = True
        self.down_since: float | None = None
        self._down_state = ""
        self._down_reason = ""
        self._down_s = 0.0
        self._failures_at_down = 0
        self._resynced = False
        #: state changes not told yet, the line budget (STATE_LINES_BURST, STATE_LINE_EVERY_S) and the line
        #: waiting for it
        self._changes = 0
        self._line_tokens = float(STATE_LINES_BURST)
        self._line_tokens_at = time.monotonic()
        self._line_timer: asyncio.TimerHandle | None = None
        #: the unexpected failures logged with their traceback during this outage (`_unexpected`)
        self._unexpected_seen: set[str] = set()

    def _client(self, config: BrokerConfig) -> aioredis.Redis:
        return aioredis.Redis.from_url(config.url, **client_options())

    @property
    def healthy(self) -> bool:
        return self.available and self.answering

    # -- lifecycle ---------------------------------------------------------------------------------------

    async def connect(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        attempt = 0
        while True:
            attempt += 1
            try:
                await self._connect()
                break
            except (RedisError, OSError) as exc:
                if time.monotonic() >= deadline:
                    raise BrokerUnreachable(
                        f"broker {self.target}: unreachable after {timeout:g} s ({attempt} attempts): {exc}"
                    ) from None
                log.warning(
                    "broker %s unreachable (attempt %d): %s; retrying in %.1f s",
                    self.target,
                    attempt,
                    exc,
                    RETRY_S,
                    extra={"broker": self.target, "state": "unreachable", "attempt": attempt},
                )
                await asyncio.sleep(RETRY_S)
        self.available = True

    def run(self) -> list[asyncio.Task[None]]:
        loop = asyncio.get_running_loop()
        self._healthy = self.healthy
        return [
            loop.create_task(self._read_loop(), name="broker-reader"),
            loop.create_task(self._probe_loop(), name="broker-probe"),
        ]

    async def close(self) -> None:
        self._stop_state_lines()
        if self._pubsub is not None:
            await self._pubsub.disconnect()
        await self.redis.aclose()

    async def _connect(self) -> None:
        """Ping, load the scripts, open the channel connection (replacing a broken one)."""
        pool = self.redis.connection_pool
        await self._drop_idle_connections()
        await self.redis.ping()
        for name in scripts.NAMES:
            self.shas[name] = await self.redis.script_load(scripts.source(name, sharded=False))
        if self._pubsub is not None:
            await self._pubsub.disconnect()
        # the pool's own kind of connection (plain, TLS, sentinel-managed), outside the pool: it waits for
        # messages as long as it takes
        pubsub = pool.connection_class(**{**pool.connection_kwargs, "socket_timeout": None})
        # redis-py leaves connect unannotated (only --strict reports the call; `unused-ignore` for the rest)
        await pubsub.connect()  # type: ignore[no-untyped-call, unused-ignore]
        self._pubsub = pubsub

    async def _drop_idle_connections(self) -> None:
        """Close the command pool's idle connections: opened before Redis went away they are dead, and the first
        command after the reconnect would fail on one (the node would lose Redis again, a second round). They
        leave the pool first, so no other task takes one while it closes; a connection in use stays with its
        command (a dead one fails it, and redis-py closes it then). Closing every connection of the pool, as
        `ConnectionPool.disconnect()` does, closed those that other tasks were using or taking at that moment:
        redis-py then wrote on a stream it had just set to None and raised AttributeError in that task, which
        killed the readiness probe (tests/cluster/test_long_outage.py), at every attempt a new chance."""
        pool = self.redis.connection_pool
        # redis-py has no call for "take the idle connections out": its list is swapped (redis is pinned)
        idle, pool._available_connections = pool._available_connections, []
        await asyncio.gather(*(connection.disconnect() for connection in idle), return_exceptions=True)

    def lost(self, exc: BaseException) -> None:
        self.last_error = str(exc) or type(exc).__name__
        if not self.available:
            return
        self.available = False
        self._health_changed("lost", self.last_error)
        for future in self._subscribing.values():
            if not future.done():
                future.set_exception(BrokerUnavailable(f"broker unreachable: {self.last_error}"))
        self._subscribing.clear()
        self.hooks.lost()
        if self._pubsub is not None:
            # The reader may still be waiting on a connection that looks open: close it, so it reconnects.
            asyncio.get_running_loop().create_task(self._pubsub.disconnect())

    # -- the channel connection --------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        while True:
            pubsub = self._pubsub
            try:
                assert pubsub is not None  # set by _connect before the loop starts
                while True:
                    self._on_reply(await pubsub.read_response(timeout=math.inf, push_request=True))
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # any failure of the channel connection: Redis is gone
                self.lost(exc)
            await self._reconnect()

    async def _reconnect(self) -> None:
        """Try every RETRY_S until Redis serves again, however many attempts fail: an attempt's failure of any
        kind is that attempt's (one that is no Redis error is logged with its traceback, `_unexpected`)."""
        while True:
            await asyncio.sleep(RETRY_S)
            try:
                await self._connect()
                await self._resubscribe(self.hooks.channels())
                await self.hooks.reconnected()
            except Exception as exc:
                if not isinstance(exc, LINK_ERRORS):
                    self._unexpected("a reconnect", exc)
                self.available = False
                self.reconnect_failures += 1
                self.last_error = str(exc) or type(exc).__name__
                log.debug("broker still unreachable: %s", self.last_error)
                continue
            # this attempt's PING and scripts were answered just now: ready at once, not at the next probe
            self.available = self.answering = True
            self._reconnected_at = time.monotonic()
            self._resynced = True
            try:
                self.hooks.back()
            except Exception as exc:  # a bug of the broker's resync: the reader stays
                self._unexpected("the resync after a reconnect", exc)
            self._health_changed("back", "")
            return

    async def _resubscribe(self, channels: list[str]) -> None:
        """SUBSCRIBE the channels on a new connection, from the reader itself (nobody else reads the
        confirmations yet): messages that come first go to the broker as usual."""
        pubsub = self._pubsub
        assert pubsub is not None
        if not channels:
            return
        await pubsub.send_command("SUBSCRIBE", *channels)
        waiting = set(channels)

        async def confirmations() -> None:
            while waiting:
                reply = await pubsub.read_response(timeout=math.inf, push_request=True)
                if reply[0] == b"subscribe":
                    waiting.discard(reply[1].decode())
                else:
                    self._on_reply(reply)

        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            await confirmations()

    def _awaiting_confirmations(self, channels: list[str]) -> list[asyncio.Future[None]]:
        """A future per channel, done when Redis confirms its subscription (`_on_reply`)."""
        loop = asyncio.get_running_loop()
        waiting = []
        for channel in channels:
            future = self._subscribing[channel] = loop.create_future()
            waiting.append(future)
        return waiting

    async def subscribe_channels(self, channels: list[str]) -> None:
        waiting = self._awaiting_confirmations(channels)
        assert self._pubsub is not None
        await self._pubsub.send_command("SUBSCRIBE", *channels)
        async with asyncio.timeout(COMMAND_TIMEOUT_S):
            await asyncio.gather(*waiting)

    def unsubscribe_channel(self, channel: str) -> None:
        if self.available and self._pubsub is not None:
            asyncio.get_running_loop().create_task(self._send_quietly("UNSUBSCRIBE", channel))

    async def _send_quietly(self, *args: str) -> None:
        try:
            assert self._pubsub is not None
            await self._pubsub.send_command(*args)
        except (RedisError, OSError) as exc:
            log.debug("broker: %s failed: %s", args[0], exc)

    def _on_reply(self, reply: Any) -> None:
        kind = reply[0]
        if kind == b"message":
            self.hooks.message(reply[1].decode(), reply[2])
        elif kind == b"subscribe":
            future = self._subscribing.pop(reply[1].decode(), None)
            if future is not None and not future.done():
                future.set_result(None)

    # -- readiness ---------------------------------------------------------------------------------------

    async def _probe_loop(self) -> None:
        """PING every PROBE_PERIOD_S (`answering`). Readiness only: publishes keep their own timeout. Nothing
        ends it but the broker's stop: a probe that fails in an unexpected way counts as not answered."""
        while True:
            await asyncio.sleep(PROBE_PERIOD_S)
            began = time.monotonic()
            try:
                answering = await self._answers_ping()
            except Exception as exc:
                self._unexpected("the readiness probe", exc)
                answering = False
            if not answering and began < self._reconnected_at:
                continue  # a reconnect made while this PING waited found Redis answering: that is newer
            if answering != self.answering:
                self.answering = answering
                self._health_changed("silent", f"did not answer PING within {PROBE_TIMEOUT_S:g} s")

    async def _answers_ping(self) -> bool:
        try:
            async with asyncio.timeout(PROBE_TIMEOUT_S):
                await self.redis.ping()
        except (RedisError, OSError, TimeoutError):
            return False
        return True

    # -- the state lines -----------------------------------------------------------------------------------

    def _health_changed(self, state: str, reason: str) -> None:
        """`healthy` may have changed (`state`: "lost" or "silent" with the `reason`, or "back"): a line tells a
        change, one when /readyz turns broker_unavailable and one when it is ready again, within the budget."""
        healthy = self.healthy
        if healthy == self._healthy:
            return
        self._healthy = healthy
        now = time.monotonic()
        if healthy:
            self._down_s = now - (self.down_since if self.down_since is not None else now)
            self.down_since = None
        else:
            self.down_since = now
            self._down_state, self._down_reason = state, reason
            self._failures_at_down = self.reconnect_failures
            self._resynced = False
            self._unexpected_seen.clear()
        self._changes += 1
        self._state_line()

    def _state_line(self) -> None:
        """Tell the state now, if the budget allows (STATE_LINES_BURST lines at once, then one per
        STATE_LINE_EVERY_S); else once it does, with how many changes the line stands for."""
        now = time.monotonic()
        self._line_tokens = min(float(STATE_LINES_BURST), self._line_tokens + (now - self._line_tokens_at) / STATE_LINE_EVERY_S)
        self._line_tokens_at = now
        if self._line_tokens < 1.0:
            if self._line_timer is None:
                self._line_timer = asyncio.get_running_loop().call_later(
                    (1.0 - self._line_tokens) * STATE_LINE_EVERY_S, self._deferred_state_line
                )
            return
        self._line_tokens -= 1.0
        changes, self._changes = self._changes, 0
        more = f"; {changes - 1} more changes since the last line" if changes > 1 else ""
        if self._healthy:
            failed = self.reconnect_failures - self._failures_at_down
            topics = self.hooks.served()
            resync = f", resynchronising {topics} topics" if self._resynced else ""
            log.warning(
                "broker %s back after %.1f s unavailable (%d failed reconnects)%s: /readyz ready%s",
                self.target,
                self._down_s,
                failed,
                more,
                resync,
                extra={
                    "broker": self.target,
                    "state": "back",
                    "down_s": round(self._down_s, 3),
                    "reconnect_failures": failed,
                    "topics": topics,
                },
            )
        else:
            log.warning(
                "broker %s unavailable (%s: %s)%s: publishes get broker_unavailable, /readyz 503 until it is back",
                self.target,
                self._down_state,
                self._down_reason,
                more,
                extra={"broker": self.target, "state": self._down_state, "reason": self._down_reason},
            )

    def _deferred_state_line(self) -> None:
        self._line_timer = None
        if self._changes:
            self._state_line()

    def _stop_state_lines(self) -> None:
        if self._line_timer is not None:
            self._line_timer.cancel()
            self._line_timer = None

    def _unexpected(self, where: str, exc: BaseException) -> None:
        """A failure that is no Redis error (a bug, a race in redis-py): told with its traceback, once per place
        and kind per outage; what failed goes on."""
        key = f"{where}: {type(exc).__name__}"
        if key in self._unexpected_seen:
            return
        self._unexpected_seen.add(key)
        log.error(
            "broker %s: %s failed unexpectedly (%s: %s); it goes on", self.target, where, type(exc).__name__, exc, exc_info=exc
        )


class SentinelLink(SingleLink):
    """The primary the sentinels name (`[broker] sentinel_addresses`, `sentinel_master`)."""

    def _client(self, config: BrokerConfig) -> aioredis.Redis:
        # redis-py leaves Sentinel unannotated (only --strict reports it; `unused-ignore` for the rest)
        self.sentinel = Sentinel(  # type: ignore[no-untyped-call, unused-ignore]
            [address(a) for a in config.sentinel_addresses],
            sentinel_kwargs={"socket_timeout": COMMAND_TIMEOUT_S, "socket_connect_timeout": COMMAND_TIMEOUT_S},
        )
        self.target = f"sentinel {config.sentinel_master!r} at {', '.join(config.sentinel_addresses)}"
        self.master = config.sentinel_master
        #: the sentinels' answers that could not be read during the last attempt to connect (for its message)
        self.malformed: list[str] = []
        # an answer that is no list of primaries fails as that sentinel not answering (the next is asked)
        for where, sentinel in zip(config.sentinel_addresses, self.sentinel.sentinels):
            callbacks = sentinel.response_callbacks
            callbacks[MASTERS] = checked_masters(callbacks[MASTERS], where, self.malformed)
        client: aioredis.Redis = self.sentinel.master_for(config.sentinel_master, **client_options())
        return client

    async def _connect(self) -> None:
        self.malformed.clear()
        try:
            await super()._connect()
        except MasterNotFoundError:
            if not self.malformed:
                raise
            # redis-py's message names each sentinel by its client's repr and the failure by its class only;
            # it asks each sentinel several times: each reason once
            raise MasterNotFoundError(
                f"no primary for {self.master!r} from the sentinels: " + "; ".join(dict.fromkeys(self.malformed))
            ) from None

    async def close(self) -> None:
        await super().close()
        await self.sentinel.aclose()


#: the command that asks a sentinel for the primaries it monitors (redis-py's key for its answer's parser)
MASTERS = "SENTINEL MASTERS"


class MalformedSentinelAnswer(RedisConnectionError):
    """A sentinel's `SENTINEL MASTERS` answer is not a list of primaries with their address. A ConnectionError,
    so redis-py counts that sentinel as not reached and asks the next; with none left the connect fails as
    for sentinels that do not answer (retried, then `BrokerUnreachable`), not with a parser's exception."""


def checked_masters(parse: Callable[..., Any], where: str, malformed: list[str]) -> Callable[..., Any]:
    """redis-py's parser of `SENTINEL MASTERS` for the sentinel at `where`, failing with
    `MalformedSentinelAnswer` (and noting why in `malformed`) on an answer it cannot read (it raises
    AttributeError, KeyError, TypeError... then) or one without what redis-py reads next: each primary's
    flags, `ip` (text), `port` and `num-other-sentinels` (numbers)."""

    def checked(response: Any, **options: Any) -> Any:
        try:
            masters = parse(response, **options)
            for name, state in masters.items():  # what redis-py's discover_master and check_master_state read
                if not (
                    isinstance(state["ip"], str)
                    and isinstance(state["port"], int)
                    and isinstance(state["num-other-sentinels"], int)
                ):
                    raise ValueError(
                        f"primary {name!r}: ip {state['ip']!r}, port {state['port']!r},"
                        f" num-other-sentinels {state['num-other-sentinels']!r}"
                    )
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
            reason = f"{where} gave a malformed {MASTERS} answer ({type(exc).__name__}: {exc})"
            malformed.append(reason)
            raise MalformedSentinelAnswer(reason) from None
        return masters

    return checked


def client_options() -> dict[str, Any]:
    """The command client's options, whatever the topology."""
    return {
        "socket_timeout": COMMAND_TIMEOUT_S,
        "socket_connect_timeout": COMMAND_TIMEOUT_S,
        # a failure is reported at once: publishes are refused, not delayed
        "retry": Retry(NoBackoff(), 0),
    }
