"""Backend hooks over HTTP (`[proxy]`, docs/integration.md "Backend hooks"): the gateway POSTs JSON to the
application and obeys its answer. `HttpHooks` implements gateway/hooks/base.py's `Hooks`.

One `HttpHooks` per process (the hub's `hooks` when a hook URL is set; `NoHooks` otherwise). It holds one
pooled `httpx.AsyncClient`, made on the first call and closed at shutdown, a bound of calls in flight per
hook (`max_concurrent`), the counts and latencies /metrics shows, and the queues of fire-and-forget events
(disconnect, unsubscribe: one queue and its senders per hook, so no flood of one kind delays or drops the
other) with the tasks that send them.

An answer is read as it comes, undecoded (`Accept-Encoding: identity`; any other Content-Encoding is
refused), up to `max_answer_bytes`: a backend, or whatever answers at its address, cannot make the gateway
hold or inflate more than that per call. httpx's per-request INFO lines are silenced; failures are logged
through the hub's bounded bad-input log (source "hook").

What a hook answers is one of: a grant / an allowance (a JSON object), a refusal (`{"error": {"code",
"message"}}`: `Refused`), or nothing usable (timeout, connection refused, a status other than 200, a body
that is not the hook's answer: `BackendUnavailable`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Hashable, Iterator
from typing import Any, TypeVar

import httpx
import msgspec
import orjson
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ..auth.identity import ClientIdentity
from ..auth.owners import check_user_id
from ..auth.tokens import MAX_PATTERNS, MAX_USER_CHARS, Principal
from ..config import ProxyConfig
from ..edge.bodies import AnswerRefused, read_answer
from ..edge.ratelog import BadInputLog
from ..errors import BackendUnavailable, ConnectRefused
from ..ops.metrics import BucketHistogram
from ..ops.tracing import NO_TRACING, Tracing, redacted
from .base import Allowed, Hooks, NoHooks, Refused, client_body

HOOKS = ("connect", "subscribe", "publish", "rpc", "refresh", "disconnect", "unsubscribe")
#: hooks whose calls are events: queued, sent in the background, retried (they carry an id)
EVENT_HOOKS = ("disconnect", "unsubscribe")
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: tasks that send events (each sends one event at a time, with its retries)
EVENT_SENDERS = 4
#: longest message of a backend's refusal kept (it becomes an error entry's message or a close reason)
MAX_MESSAGE_CHARS = 200
#: every call's request headers: a JSON body, and an answer as sent (never a compressed one to inflate)
REQUEST_HEADERS = {"content-type": "application/json", "accept-encoding": "identity"}

T = TypeVar("T")


class Grant(msgspec.Struct, frozen=True):
    """The connect hook's answer (unknown keys are ignored, so a backend may answer more)."""

    user: str
    subscribe: list[str] = []
    publish: list[str] = []
    topics: list[str] = []
    info: dict[str, Any] | None = None
    expires_at: float | None = None


class RefreshAnswer(msgspec.Struct, frozen=True):
    expires_at: float


class _Failed(Exception):
    """A call that got no usable answer: its /metrics `outcome` and what the client is told."""

    def __init__(self, outcome: str, message: str) -> None:
        super().__init__(message)
        self.outcome = outcome


def _refusal(error: object) -> Refused:
    if isinstance(error, dict):
        code, message = error.get("code"), error.get("message")
    else:
        code, message = None, error
    text = message if isinstance(message, str) else "" if message is None else str(message)
    return Refused(code, text[:MAX_MESSAGE_CHARS])


class EventQueue:
    """The events of one hook waiting to be sent (bodies with a `client`, an unsubscribe's with a `topic`).
    Bounded three ways: at most `max_events` in all and `per_client` of one client (beyond: "dropped"), and
    one event per (client, topic): a client's unsubscribe from a topic while one for it still waits is that
    same event ("coalesced"), so toggling a subscription costs one slot, not one per toggle."""

    def __init__(self, max_events: int, per_client: int) -> None:
        self.per_client = per_client
        self.queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(max_events)
        self.waiting: set[tuple[Hashable, Any]] = set()
        self.by_client: Counter[Hashable] = Counter()

    @staticmethod
    def _key(body: dict[str, Any]) -> tuple[Hashable, Any]:
        return body["client"], body.get("topic")

    def put(self, body: dict[str, Any]) -> str | None:
        """Queue `body`; None when queued, else the outcome it is counted with instead."""
        key = self._key(body)
        if key in self.waiting:
            return "coalesced"
        if self.by_client[key[0]] >= self.per_client or self.queue.full():
            return "dropped"
        body["id"] = secrets.token_hex(16)  # the same on every attempt: the backend drops a duplicate by it
        body["time"] = time.time()
        self.queue.put_nowait(body)
        self.waiting.add(key)
        self.by_client[key[0]] += 1
        return None

    async def get(self) -> dict[str, Any]:
        """The next event; from now on a new one of the same client and topic is queued again."""
        body = await self.queue.get()
        key = self._key(body)
        self.waiting.discard(key)
        self.by_client[key[0]] -= 1
        if not self.by_client[key[0]]:
            del self.by_client[key[0]]
        return body


def _quiet_httpx() -> None:
    """httpx logs every request at INFO: one line per anonymous rpc, a log any client could fill."""
    for name in ("httpx", "httpcore"):
        logging.getLogger(name).setLevel(logging.WARNING)


def hooks_from_config(
    config: ProxyConfig, max_subscriptions: int, bad_input: BadInputLog, tracing: Tracing = NO_TRACING
) -> Hooks:
    """The process's hooks: over HTTP when a hook URL is set, else `NoHooks`."""
    urls = (
        config.connect_url,
        config.subscribe_url,
        config.publish_url,
        config.rpc_url,
        config.refresh_url,
        config.disconnect_url,
        config.unsubscribe_url,
    )
    return HttpHooks(config, max_subscriptions, bad_input, tracing) if any(urls) else NoHooks()


class HttpHooks:
    def __init__(
        self, config: ProxyConfig, max_subscriptions: int, bad_input: BadInputLog, tracing: Tracing = NO_TRACING
    ) -> None:
        self.config = config
        self.max_subscriptions = max_subscriptions
        #: the hub's bounded log: a hook's failures (a dead backend logs at that rate, not once per call)
        self.bad_input = bad_input
        self.urls = {
            "connect": config.connect_url,
            "subscribe": config.subscribe_url,
            "publish": config.publish_url,
            "rpc": config.rpc_url,
            "refresh": config.refresh_url,
            "disconnect": config.disconnect_url,
            "unsubscribe": config.unsubscribe_url,
        }
        # one flag per hook: the questions of `Hooks` the call sites ask, and those asked here
        self.asks_subscribe = bool(config.subscribe_url)
        self.asks_publish = bool(config.publish_url)
        self.answers_rpc = bool(config.rpc_url)
        self.refreshes = bool(config.refresh_url)
        self._asks_connect = bool(config.connect_url)
        self._tells_disconnect = bool(config.disconnect_url)
        self._tells_unsubscribe = bool(config.unsubscribe_url)
        self.forward_headers = tuple(config.forward_headers)
        #: `Retry-After` of the HTTP 503 answers of POST /lp and GET /sse
        self.retry_after = {"Retry-After": str(config.retry_after_s)}
        self._client: httpx.AsyncClient | None = None
        self._slots = {hook: asyncio.Semaphore(config.max_concurrent) for hook in HOOKS}
        #: calls by (hook, outcome): ok, refused, timeout, unavailable, error (HTTP status), bad_answer, and
        #: for events not sent: dropped, coalesced
        self.outcomes: Counter[tuple[str, str]] = Counter()
        self.durations = {hook: BucketHistogram(DURATION_BUCKETS) for hook in HOOKS}
        #: one queue per event hook, made with its senders on its first event
        self._events: dict[str, EventQueue] = {}
        self._senders: list[asyncio.Task[None]] = []
        #: calls in flight for connections and commands (kept so they are not collected, cancelled at close)
        self._tasks: set[asyncio.Task[Any]] = set()
        #: each call is a client span, its `traceparent` sent along (with [tracing] on)
        self.tracing = tracing
        #: the hooks' URLs as a span shows them, redacted once
        self._span_urls = {hook: redacted(url) for hook, url in self.urls.items()}

    # -- calls ---------------------------------------------------------------------------------------------

    def client(self) -> httpx.AsyncClient:
        client = self._client
        if client is None:
            limits = httpx.Limits(
                max_connections=self.config.max_concurrent * len(HOOKS), max_keepalive_connections=self.config.max_concurrent
            )
            _quiet_httpx()
            client = self._client = httpx.AsyncClient(
                timeout=self.config.timeout_s, limits=limits, follow_redirects=False, trust_env=False
            )
        return client

    async def call(self, hook: str, body: dict[str, Any], answer: type[T]) -> T:
        """POST `body` to the hook's URL and return its answer as `answer`. Raises `Refused` (the backend's
        `error`) or `BackendUnavailable` (no answer within `timeout_s`, waiting for a slot included; not
        reachable; a status other than 200; a body that is not the hook's answer, or longer than
        `max_answer_bytes`, or encoded). A failure is logged through the bounded bad-input log."""
        tracing = self.tracing
        headers = dict(REQUEST_HEADERS)
        with tracing.client_span(f"hook {hook}", headers, {"fanout.hook": hook, "url.full": self._span_urls[hook]}) as span:
            try:
                converted = await self._call(hook, body, answer, headers)
            except Refused:
                span.set_attribute("fanout.hook.outcome", "refused")
                tracing.ok(span)  # the backend answered: a refusal is no failure of the call
                raise
            except BackendUnavailable:
                span.set_attribute("fanout.hook.outcome", "unavailable")
                raise
            span.set_attribute("fanout.hook.outcome", "ok")
            return converted

    async def _call(self, hook: str, body: dict[str, Any], answer: type[T], headers: dict[str, str]) -> T:
        started = time.perf_counter()
        outcome = "error"
        try:
            try:
                converted = self._answer(await self._post(hook, body, headers), answer)
            except Refused:
                outcome = "refused"
                raise
            except _Failed as failed:
                outcome = failed.outcome
                self.bad_input("hook", "the %s hook %s", hook, failed)
                raise BackendUnavailable(f"backend unavailable: the {hook} hook {failed}") from None
            outcome = "ok"
            return converted
        finally:
            self.outcomes[(hook, outcome)] += 1
            self.durations[hook].observe(time.perf_counter() - started)

    async def _post(self, hook: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
        """The body of the hook's answer, within `timeout_s` (waiting for a slot included). Raises _Failed."""
        timeout = self.config.timeout_s
        try:
            async with asyncio.timeout(timeout):
                async with self._slots[hook]:
                    return await self._read_answer(hook, body, headers)
        except (TimeoutError, httpx.TimeoutException):
            raise _Failed("timeout", f"did not answer within {timeout:g} s (proxy.timeout_s)") from None
        except httpx.HTTPError as exc:
            raise _Failed("unavailable", f"could not be reached ({type(exc).__name__})") from None

    async def _read_answer(self, hook: str, body: dict[str, Any], headers: dict[str, str]) -> bytes:
        """POST and read the answer as it comes, undecoded, up to `max_answer_bytes`: past that (or a
        Content-Length above it) the connection is closed with the rest unread."""
        async with self.client().stream("POST", self.urls[hook], content=orjson.dumps(body), headers=headers) as response:
            if response.status_code != 200:
                raise _Failed("error", f"answered HTTP {response.status_code}")
            try:
                return await read_answer(response, self.config.max_answer_bytes, "proxy.max_answer_bytes")
            except AnswerRefused as exc:
                raise _Failed("bad_answer", str(exc)) from None

    @staticmethod
    def _answer(content: bytes, answer: type[T]) -> T:
        """The body as the hook's answer. Raises Refused (the backend's `error`) or _Failed."""
        try:
            doc = orjson.loads(content)
        except orjson.JSONDecodeError:
            doc = None
        if not isinstance(doc, dict):
            raise _Failed("bad_answer", "answered something that is not a JSON object")
        if "error" in doc:
            raise _refusal(doc["error"])
        try:
            return msgspec.convert(doc, answer)
        except msgspec.ValidationError as exc:
            raise _Failed("bad_answer", f"answered a malformed answer: {exc}") from None

    def spawn(self, coroutine: Coroutine[Any, Any, Any]) -> None:
        """Run a call for a connection or a command in the background (cancelled at close)."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def body(self, identity: ClientIdentity, **more: Any) -> dict[str, Any]:
        return client_body(identity, **more)

    # -- connect -------------------------------------------------------------------------------------------

    def wants_connect(self, identity: ClientIdentity) -> bool:
        """Whether this new client goes through the connect hook: one without a token, or every one with
        `connect_always`."""
        return self._asks_connect and (identity.principal is None or self.config.connect_always)

    async def connect(self, identity: ClientIdentity, header_values: Callable[[str], list[str]]) -> tuple[str, ...]:
        """Ask the connect hook about a new client and apply its grant to `identity` (user, patterns, expiry
        as its `Principal`; `info`); returns its server-side `topics`. Raises ConnectRefused or BackendUnavailable."""
        headers = {}
        for name in self.forward_headers:
            values = header_values(name)
            if values:
                headers[name] = ("; " if name.lower() == "cookie" else ", ").join(values)
        body = self.body(identity, address=identity.ip, headers=headers)
        try:
            grant = await self.call("connect", body, Grant)
        except Refused as exc:
            raise ConnectRefused(exc.message or "connection refused by the backend") from None
        problem = self._check(grant)
        if problem is not None:
            self.outcomes[("connect", "ok")] -= 1
            self.outcomes[("connect", "bad_answer")] += 1
            self.bad_input("hook", "the connect hook answered a malformed grant: %s", problem)
            raise BackendUnavailable(f"backend unavailable: the connect hook's answer is malformed: {problem}")
        if grant.user:
            # with `connect_always` the client may hold a token: its jti and iat stay the connection's, so
            # revoking that token (by jti, or its user's tokens issued before T) still closes it
            token = identity.principal
            identity.principal = Principal(
                grant.user,
                grant.expires_at if grant.expires_at is not None else math.inf,
                tuple(grant.subscribe),
                tuple(grant.publish),
                grant.info,
                proxied=True,
                jti=token.jti if token is not None else None,
                issued_at=token.issued_at if token is not None else None,
            )
        if grant.info is not None:
            identity.info = grant.info
        return tuple(grant.topics)

    def _check(self, grant: Grant) -> str | None:
        if len(grant.user) > MAX_USER_CHARS:
            return f"user is longer than {MAX_USER_CHARS} characters"
        if grant.user:
            reserved = check_user_id(grant.user)
            if reserved is not None:
                return reserved
        if len(grant.subscribe) > MAX_PATTERNS or len(grant.publish) > MAX_PATTERNS:
            return f"more than {MAX_PATTERNS} patterns"
        if len(grant.topics) > self.max_subscriptions:
            return f"more than {self.max_subscriptions} topics (scheduler.max_subscriptions)"
        if grant.expires_at is not None and not math.isfinite(grant.expires_at):
            return "expires_at is not a finite number"
        return None

    # -- refresh -------------------------------------------------------------------------------------------

    async def refresh(self, identity: ClientIdentity) -> float:
        """The new expiry the refresh hook gives a proxy-granted connection. Raises Refused, BackendUnavailable."""
        answer = await self.call("refresh", self.body(identity), RefreshAnswer)
        return answer.expires_at

    # -- events --------------------------------------------------------------------------------------------

    def disconnected(self, identity: ClientIdentity, reason: str) -> None:
        """A registered client is gone (`reason`: the /metrics disconnect reason)."""
        if self._tells_disconnect:
            self._event("disconnect", self.body(identity, reason=reason))

    def unsubscribed(self, identity: ClientIdentity, topic: str) -> None:
        """An explicit `unsubscribe` (not the subscriptions a disconnect ends: `disconnected` covers them)."""
        if self._tells_unsubscribe:
            self._event("unsubscribe", self.body(identity, topic=topic))

    def _event(self, hook: str, body: dict[str, Any]) -> None:
        queue = self._events.get(hook)
        if queue is None:
            queue = self._events[hook] = EventQueue(self.config.event_queue_max, self.config.event_queue_per_client)
            loop = asyncio.get_running_loop()
            self._senders += [loop.create_task(self._send_events(hook, queue)) for _ in range(EVENT_SENDERS)]
        not_queued = queue.put(body)
        if not_queued is not None:
            self.outcomes[(hook, not_queued)] += 1

    def pending(self, hook: str) -> int:
        """Events of `hook` waiting to be sent (those being sent not counted)."""
        queue = self._events.get(hook)
        return 0 if queue is None else queue.queue.qsize()

    async def _send_events(self, hook: str, queue: EventQueue) -> None:
        retries, backoff = self.config.event_retries, self.config.event_backoff_s
        while True:
            body = await queue.get()
            try:
                for attempt in range(retries + 1):
                    try:
                        await self.call(hook, body, Allowed)
                        break
                    except Refused:
                        break  # the backend answered: nothing to retry
                    except BackendUnavailable:
                        if attempt < retries:
                            await asyncio.sleep(backoff * 2**attempt)
                        else:
                            self.bad_input("hook", "%s event %s not delivered after %d attempts", hook, body["id"], retries + 1)
            finally:
                queue.queue.task_done()

    # -- lifecycle, metrics --------------------------------------------------------------------------------

    async def aclose(self) -> None:
        """At shutdown: the events queued (the clients' disconnects among them) get at most `timeout_s` to
        go, then every call is cancelled and the pooled client closed."""
        waiting = [queue.queue.join() for queue in self._events.values() if queue.queue.qsize()]
        if waiting:
            try:
                async with asyncio.timeout(min(self.config.timeout_s, 5.0)):
                    await asyncio.gather(*waiting)
            except TimeoutError:
                pass
        for task in (*self._senders, *self._tasks):
            task.cancel()
        for task in (*self._senders, *self._tasks):
            try:
                await task
            except BaseException:  # cancelled, or a failure already answered
                pass
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "fanout_proxy_requests",
            "backend hook calls ([proxy]) by hook and outcome:"
            " ok, refused, timeout, unavailable, error (HTTP status), bad_answer (not"
            " a hook answer, encoded, or above max_answer_bytes); events not sent:"
            " dropped (queue full), coalesced (the same event waits)",
            labels=["hook", "outcome"],
        )
        for (hook, outcome), count in sorted(self.outcomes.items()):
            requests.add_metric([hook, outcome], count)
        yield requests
        pending = GaugeMetricFamily("fanout_proxy_events_pending", "events waiting to be sent, by hook", labels=["hook"])
        for hook in EVENT_HOOKS:
            if self.urls[hook]:
                pending.add_metric([hook], self.pending(hook))
        yield pending
        durations = HistogramMetricFamily(
            "fanout_proxy_duration_seconds", "backend hook call durations, waiting for a slot included", labels=["hook"]
        )
        for hook in HOOKS:
            if self.urls[hook]:
                histogram = self.durations[hook]
                durations.add_metric([hook], histogram.cumulative(), histogram.total)
        yield durations
