"""Token keys from a JWKS endpoint (`auth.jwks_url`): what SSO providers (Keycloak, Auth0, Okta) publish and
rotate.

Design (docs/security.md, "JWKS"): token checks stay synchronous (`TokenVerifier.verify` runs in the
WebSocket handshake and in the `auth` command), so the network is never on their path. This module keeps the
last good key set in memory and refreshes it in a background task (httpx.AsyncClient):

* at start (`start`, awaited up to FETCH_TIMEOUT_S so the first clients find the keys), then every
  Cache-Control max-age of the answer, held between `auth.jwks_refresh_min_s` (floor) and
  `auth.jwks_cache_max_s` (ceiling; also the period when the answer has no max-age);
* when a token names a `kid` the set lacks: that token is refused now as a passing state (`keys_refreshing`:
  WebSocket close 1013, HTTP 503, so clients retry later with the same token) and the task fetches again,
  at once or `auth.jwks_refresh_min_s` after the last fetch began, one fetch however many unknown `kid`s
  asked meanwhile: a flood of made-up key ids is no flood of fetches, and a client that retries finds a key
  rotated in meanwhile within `jwks_refresh_min_s`. A `kid` still missing from a set fetched after it was
  first asked for is no passing state: `bad_token` (4001, final);
* when a fetch fails (network, status, body), the last good set is kept, and the next try comes after
  `auth.jwks_refresh_min_s`.

The URL is the configured one, only: nothing of a token (`jku`, `x5u`, `x5c` headers) is ever fetched or
used. Only asymmetric keys are taken (RS256, ES256, EdDSA), each checking its one algorithm: a symmetric
(`oct`) key from a URL is skipped, and a token's `alg` must be the key's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Iterator
from typing import Any, NoReturn

import httpx
import orjson
from jwt import PyJWK, PyJWTError
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..edge.bodies import AnswerRefused, read_answer
from ..errors import BadToken, KeysRefreshing

log = logging.getLogger("gateway.auth")

#: the algorithms a key from the set may check (its `alg`, or the one its type and curve imply)
JWKS_ALGORITHMS = ("RS256", "ES256", "EdDSA")
#: seconds one fetch may take (connect, the whole answer) before it counts as failed
FETCH_TIMEOUT_S = 5.0
#: a key set is a few KiB; more is refused, and so is a set of more than MAX_KEYS usable keys
MAX_BODY_BYTES = 256 * 1024
MAX_KEYS = 64
#: a `kid` longer than this is no key id of ours (it is only ever looked up, never echoed whole)
MAX_KID_CHARS = 256
#: unknown `kid`s remembered with when they were first asked for (the oldest forgotten beyond)
MAX_ASKED_KIDS = 4096
_MAX_AGE = re.compile(r"(?:^|,)\s*max-age\s*=\s*\"?(\d+)\"?\s*(?:,|$)", re.IGNORECASE)


class JwksError(ValueError):
    """The endpoint's answer is not a usable key set."""


def parse_key_set(body: bytes) -> dict[str, PyJWK]:
    """The usable signing keys of a JWKS document by `kid` (a key without one under ""); JwksError when
    there is none (the caller keeps its last good set)."""
    try:
        document = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise JwksError(f"not JSON: {exc}") from None
    entries = document.get("keys") if isinstance(document, dict) else None
    if not isinstance(entries, list):
        raise JwksError('not a key set: no "keys" list')
    keys: dict[str, PyJWK] = {}
    skipped: list[str] = []
    for entry in entries:
        key = _signing_key(entry, skipped)
        if key is not None:
            keys[key.key_id or ""] = key
    if not keys:
        raise JwksError(f"no usable key (RS256, ES256 or EdDSA); skipped: {', '.join(skipped[:5]) or 'none'}")
    if len(keys) > MAX_KEYS:
        raise JwksError(f"{len(keys)} keys: more than {MAX_KEYS}")
    return keys


def _signing_key(entry: Any, skipped: list[str]) -> PyJWK | None:
    if not isinstance(entry, dict):
        skipped.append("an entry that is not an object")
        return None
    kid = entry.get("kid")
    name = repr(kid)[:40] if kid is not None else "a key without kid"
    if entry.get("use", "sig") != "sig" or (kid is not None and not isinstance(kid, str)):
        skipped.append(name)
        return None
    try:
        key = PyJWK(entry)
    except (PyJWTError, ValueError, TypeError, KeyError) as exc:  # unknown kty / crv / alg, a broken key
        skipped.append(f"{name} ({type(exc).__name__})")
        return None
    if key.algorithm_name not in JWKS_ALGORITHMS:  # HS256 (`oct`) above all: never a secret from a URL
        skipped.append(f"{name} ({key.algorithm_name})")
        return None
    return key


def max_age(cache_control: str | None) -> float | None:
    """The max-age of a Cache-Control header in seconds, or None (absent, or `no-store` / `no-cache`: then
    the ceiling applies, held by the floor like any other)."""
    if not cache_control:
        return None
    match = _MAX_AGE.search(cache_control)
    return float(match.group(1)) if match else None


class JwksKeys:
    """The key set of `url`, refreshed in the background (module docstring)."""

    def __init__(self, url: str, refresh_min_s: float, cache_max_s: float) -> None:
        self.url = url
        self.refresh_min_s = refresh_min_s
        self.cache_max_s = max(cache_max_s, refresh_min_s)
        self.keys: dict[str, PyJWK] = {}
        #: fetches that loaded a set and that failed, tokens refused for an unknown `kid` (/metrics)
        self.loaded = 0
        self.failures = 0
        self.unknown_kids = 0
        #: when the last fetch began (monotonic): the next begins refresh_min_s after it at the earliest
        self._last_fetch = -float("inf")
        #: when the last fetch that loaded a set began (monotonic)
        self._loaded_from = -float("inf")
        #: unknown `kid`s -> when first asked for (monotonic): one is final once a set fetched after that lacks it
        self._asked: dict[str, float] = {}
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._client: httpx.AsyncClient | None = None

    async def start(self) -> None:
        """Fetch the set once (the first clients find it), then keep it fresh in the background."""
        self._wake = asyncio.Event()
        # trust_env=False: no proxy or netrc from the environment; the one URL configured, nothing else
        self._client = httpx.AsyncClient(timeout=FETCH_TIMEOUT_S, follow_redirects=False, trust_env=False)
        next_in = await self._refresh()
        self._task = asyncio.get_running_loop().create_task(self._refresh_loop(next_in), name="jwks-refresh")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            await self._client.aclose()

    def find(self, kid: object, algorithm: str) -> PyJWK:
        """The key of a token whose header names `kid` and `algorithm`; BadToken when there is none, or
        KeysRefreshing while a refetch may bring it (`_unknown`)."""
        if kid is None and len(self.keys) == 1:
            key = next(iter(self.keys.values()))  # one key and a token that names none: that one
        elif isinstance(kid, str) and len(kid) <= MAX_KID_CHARS and kid in self.keys:
            key = self.keys[kid]
        elif not self.keys:
            self.refetch_soon()
            raise KeysRefreshing("the key set (auth.jwks_url) is not loaded yet: retry later")
        elif kid is None:
            raise BadToken("the token names no key id (kid) and the key set has several keys")
        else:
            self.unknown_kids += 1
            self._unknown(kid)
        if key.algorithm_name != algorithm:
            raise BadToken(f"token algorithm {algorithm!r} is not the algorithm of its key ({key.algorithm_name})")
        return key

    def _unknown(self, kid: object) -> NoReturn:
        """Refuse a token naming a `kid` the set lacks: KeysRefreshing (and a refetch) until a set fetched
        after it was first asked for lacks it too, then BadToken."""
        if not isinstance(kid, str) or len(kid) > MAX_KID_CHARS:
            raise BadToken("unknown key id")
        now = time.monotonic()
        first = self._asked.get(kid)
        if first is None:
            if len(self._asked) >= MAX_ASKED_KIDS:
                del self._asked[next(iter(self._asked))]
            first = self._asked[kid] = now
        if self._loaded_from > first:
            raise BadToken("unknown key id: not in the key set (auth.jwks_url) fetched since it was first seen")
        self.refetch_soon()
        raise KeysRefreshing("unknown key id, the key set is being refreshed: retry later")

    def refetch_soon(self) -> None:
        """Ask the refresh task for a fetch: at once, or refresh_min_s after the last one began. However many
        ask meanwhile, that is one fetch (`_refresh_loop`)."""
        if self._wake is not None:
            self._wake.set()

    async def _refresh_loop(self, next_in: float) -> None:
        assert self._wake is not None
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(next_in):
                    await self._wake.wait()
            wait_more = self.refresh_min_s - (time.monotonic() - self._last_fetch)
            if wait_more > 0:  # the floor holds for every fetch, whatever woke this one
                await asyncio.sleep(wait_more)
            self._wake.clear()
            next_in = await self._refresh()

    async def _refresh(self) -> float:
        try:
            return await self._fetch()
        except Exception:  # a bug of ours must not end the refreshes: the last good set stays, retried later
            log.exception("auth.jwks_url %s: fetch failed", self.url, extra={"url": self.url, "reason": "bug"})
            self.failures += 1
            return self.refresh_min_s

    async def _fetch(self) -> float:
        """Fetch and parse the set; keep the last good one on any failure. Returns the seconds until the
        next scheduled fetch."""
        assert self._client is not None
        self._last_fetch = time.monotonic()
        try:
            async with asyncio.timeout(FETCH_TIMEOUT_S):  # the whole fetch: a slow drip of bytes is cut too
                body, cache_control = await self._get()
            keys = parse_key_set(body)
        except (httpx.HTTPError, JwksError, OSError, TimeoutError) as exc:
            self.failures += 1
            reason = str(exc) or type(exc).__name__  # a timeout says nothing itself
            log.warning(
                "auth.jwks_url %s: fetch failed (%s); keeping the %d keys loaded before, next try in %g s",
                self.url,
                reason,
                len(self.keys),
                self.refresh_min_s,
                extra={"url": self.url, "reason": reason},
            )
            return self.refresh_min_s
        if set(keys) != set(self.keys):
            log.info(
                "auth.jwks_url %s: %d keys (%s)",
                self.url,
                len(keys),
                ", ".join(sorted(keys))[:200],
                extra={"url": self.url, "keys": len(keys)},
            )
        self.keys = keys
        self.loaded += 1
        self._loaded_from = self._last_fetch
        for kid in keys:
            self._asked.pop(kid, None)
        age = max_age(cache_control)
        return min(max(age if age is not None else self.cache_max_s, self.refresh_min_s), self.cache_max_s)

    async def _get(self) -> tuple[bytes, str | None]:
        assert self._client is not None
        headers = {"Accept": "application/json", "Accept-Encoding": "identity"}
        async with self._client.stream("GET", self.url, headers=headers) as reply:
            if reply.status_code != 200:
                raise JwksError(f"HTTP {reply.status_code}")
            try:
                body = await read_answer(reply, MAX_BODY_BYTES, "the JWKS bound")
            except AnswerRefused as exc:
                raise JwksError(str(exc)) from None
            return body, reply.headers.get("cache-control")

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily("fanout_auth_jwks_keys", "keys of the auth.jwks_url set in use", value=len(self.keys))
        fetches = CounterMetricFamily("fanout_auth_jwks_fetches", "fetches of auth.jwks_url, by result", labels=["result"])
        fetches.add_metric(["ok"], self.loaded)
        fetches.add_metric(["failed"], self.failures)
        yield fetches
        yield CounterMetricFamily(
            "fanout_auth_jwks_unknown_kid", "tokens refused for a kid the key set lacks", value=self.unknown_kids
        )
