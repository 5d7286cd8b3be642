"""The gateway's admin API as the feed uses it (docs/protocol.md, "Admin API"): read a topic's settings and
state (``GET /api/topics/NAME``: capacity, reorder window, batch depth, hole timeout, epoch, available end),
and for a topic not created yet the rule it will be created by (``GET /api/rules/NAME``).

Plain ``http.client`` with one kept-alive connection (the driver asks a few times per micro-batch), bounded
retries while the gateway is down (:mod:`pipeline.retry`). The token: ``--admin-token``, else the
environment variable ``GATEWAY_SERVER_ADMIN_TOKEN`` (the gateway's own variable for ``server.admin_token``,
so one ``export`` serves both; ``make run`` prints the token it generated when none is set).
"""

from __future__ import annotations

import http.client
import logging
import os
import time
import urllib.parse
from dataclasses import dataclass
from typing import Any

import orjson

from pipeline.errors import AdminRefused, GatewayUnreachable
from pipeline.retry import DEFAULT_RETRY, RetryPolicy

__all__ = ["DEFAULT_ADMIN_URL", "TOKEN_VARIABLE", "AdminClient", "TopicState"]

DEFAULT_ADMIN_URL = "http://127.0.0.1:8080"
TOKEN_VARIABLE = "GATEWAY_SERVER_ADMIN_TOKEN"
#: Beyond this many topics in one micro-batch, one ``GET /api/topics`` replaces a request per topic.
LIST_ALL_ABOVE = 32

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TopicState:
    """A topic's settings and, when it exists, its state; for a topic not created yet, its rule's settings."""

    name: str
    exists: bool
    kind: str
    capacity: int
    #: an integer, or "auto" (ring topics)
    batch_depth: int | str
    reorder_window: int
    hole_timeout: float
    #: the topic's epoch; None when it does not exist yet
    epoch: str | None = None
    #: the ring's available end (first seq not delivered yet); 0 for a topic not created yet; None for a
    #: snapshot topic (it conflates: a stale seq there is never a loss of ours)
    end: int | None = 0
    #: the rule's pattern, for a topic not created yet (what to change in the config)
    pattern: str | None = None

    @classmethod
    def from_info(cls, info: dict[str, Any], exists: bool) -> TopicState:
        return cls(
            name=info["name"], exists=exists, kind=info.get("kind", "ring"), capacity=int(info.get("capacity", 0)),
            batch_depth=info.get("batch_depth", 1), reorder_window=int(info.get("reorder_window", 0)),
            hole_timeout=float(info.get("hole_timeout", 0.0)), epoch=info.get("epoch") if exists else None,
            end=(int(info.get("end", 0)) if exists else 0) if info.get("kind", "ring") == "ring" else None,
            pattern=info.get("pattern"),
        )  # fmt: skip

    def describe(self) -> str:
        where = "topic" if self.exists else f"rule {self.pattern!r} for"
        return (
            f"{where} {self.name!r}: {self.kind}, capacity {self.capacity}, reorder_window {self.reorder_window}, "
            f"batch_depth {self.batch_depth}, hole_timeout {self.hole_timeout} s"
        )


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, (OSError, http.client.HTTPException))


class AdminClient:
    def __init__(
        self, url: str = DEFAULT_ADMIN_URL, token: str | None = None, *, timeout: float = 10.0, retry: RetryPolicy = DEFAULT_RETRY
    ) -> None:
        parsed = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
        if parsed.scheme not in ("http", "https") or not parsed.hostname:
            raise ValueError(f"--admin-url wants http://HOST:PORT, got {url!r}")
        self.scheme = parsed.scheme
        self.host = parsed.hostname
        self.port = parsed.port or (443 if parsed.scheme == "https" else 80)
        self.prefix = parsed.path.rstrip("/")
        self.token = token if token is not None else os.environ.get(TOKEN_VARIABLE, "")
        self.timeout = timeout
        self.retry = retry
        self._conn: http.client.HTTPConnection | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- requests ------------------------------------------------------------------------------------------
    def _request_once(self, method: str, path: str) -> tuple[int, Any]:
        reused = self._conn is not None
        if self._conn is None:
            cls = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
            self._conn = cls(self.host, self.port, timeout=self.timeout)
        headers = {"Authorization": f"Bearer {self.token}", "Accept": "application/json"}
        try:
            self._conn.request(method, self.prefix + path, headers=headers)
            response = self._conn.getresponse()
            body = response.read()
        except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
            self.close()
            if reused:  # the server closed an idle kept-alive connection: a new one, at once
                return self._request_once(method, path)
            raise
        except BaseException:
            self.close()
            raise
        try:
            return response.status, orjson.loads(body) if body else None
        except orjson.JSONDecodeError:
            return response.status, {"error": {"code": "not_json", "message": body[:200].decode("utf-8", "replace")}}

    def request(self, method: str, path: str) -> tuple[int, Any]:
        """(status, JSON body); retries while the gateway cannot be reached, then :class:`GatewayUnreachable`."""
        if not self.token:
            raise AdminRefused(
                f"the feed reads topic settings from the gateway's admin API at {self.address} and needs its token: "
                f"set {TOKEN_VARIABLE} (`make run` prints the generated one) or pass --admin-token"
            )
        started = time.monotonic()

        def warn(exc: BaseException, delay: float) -> None:
            log.warning("admin API %s: %s; retrying in %.1f s", self.address, exc, delay)

        try:
            status, body = self.retry.call(lambda: self._request_once(method, path), _retryable, warn)
        except (OSError, http.client.HTTPException) as exc:
            raise GatewayUnreachable(
                f"cannot reach the gateway's admin API at {self.address} ({self.retry.attempts} retries over "
                f"{time.monotonic() - started:.0f} s): {exc or type(exc).__name__}"
            ) from None
        if status == 401:
            raise AdminRefused(
                f"the gateway's admin API at {self.address} refused the token (401 unauthorized): set "
                f"{TOKEN_VARIABLE} or --admin-token to the gateway's server.admin_token"
            )
        return status, body

    @staticmethod
    def _code(body: Any) -> str | None:
        return body.get("error", {}).get("code") if isinstance(body, dict) else None

    def _get_or_none(self, path: str) -> dict | None:
        status, body = self.request("GET", path)
        if status == 200:
            return body
        if status == 404 and self._code(body) == "unknown_topic":
            return None
        raise AdminRefused(
            f"GET {path} at {self.address}: {status} {self._code(body)}: "
            f"{(body or {}).get('error', {}).get('message', '') if isinstance(body, dict) else body}"
        )

    def topic_info(self, name: str) -> dict | None:
        return self._get_or_none(f"/api/topics/{urllib.parse.quote(name, safe='')}")

    def rule_info(self, name: str) -> dict | None:
        path = f"/api/rules/{urllib.parse.quote(name, safe='')}"
        status, body = self.request("GET", path)
        if status == 200:
            return body
        if status == 404 and self._code(body) == "unknown_topic":
            return None
        if status == 404:
            raise AdminRefused(
                f"the gateway at {self.address} has no GET /api/rules (an older gateway): create "
                f"topic {name!r} first (POST /api/topics) so the feed can read its settings"
            )
        raise AdminRefused(f"GET {path} at {self.address}: {status} {self._code(body)}")

    def topics(self, names: list[str]) -> dict[str, TopicState]:
        """The state of each topic in ``names``; a topic not created yet gets its rule's settings. Raises
        :class:`AdminRefused` for a name no topic and no rule covers (the ingest would answer unknown_topic)."""
        found: dict[str, dict] = {}
        if len(names) > LIST_ALL_ABOVE:
            status, body = self.request("GET", "/api/topics")
            if status != 200:
                raise AdminRefused(f"GET /api/topics at {self.address}: {status} {self._code(body)}")
            wanted = set(names)
            found = {t["name"]: t for t in body.get("topics", []) if t.get("name") in wanted}
        else:
            for name in names:
                info = self.topic_info(name)
                if info is not None:
                    found[name] = info
        out = {}
        for name in names:
            if name in found:
                out[name] = TopicState.from_info(found[name], exists=True)
                continue
            rule = self.rule_info(name)
            if rule is None:
                raise AdminRefused(
                    f"no topic {name!r} at the gateway ({self.address}) and no rule creates it: add a "
                    f"[[topics.rules]] entry or create it with POST /api/topics"
                )
            out[name] = TopicState.from_info(rule, exists=False)
        return out
