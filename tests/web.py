"""httpx with one TLS context for the whole suite: httpx makes a new one for every client (and every `httpx.get`),
loading the CA bundle again, ~0.2 s each on a busy machine, which was most of some tests' time. The same
requests on the same connections (`get` / `post` / `request`: a client, so a connection, of their own)."""

from __future__ import annotations

from typing import Any

import httpx

#: what httpx makes by default, made once
TLS = httpx.create_ssl_context()


def _tls(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {"verify": TLS, **kwargs}


def get(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.get(url, **_tls(kwargs))


def post(url: str, **kwargs: Any) -> httpx.Response:
    return httpx.post(url, **_tls(kwargs))


def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
    return httpx.request(method, url, **_tls(kwargs))


def Client(**kwargs: Any) -> httpx.Client:  # noqa: N802 - httpx's name
    return httpx.Client(**_tls(kwargs))


def AsyncClient(**kwargs: Any) -> httpx.AsyncClient:  # noqa: N802 - httpx's name
    return httpx.AsyncClient(**_tls(kwargs))


def AsyncHTTPTransport(**kwargs: Any) -> httpx.AsyncHTTPTransport:  # noqa: N802 - httpx's name
    return httpx.AsyncHTTPTransport(**_tls(kwargs))
