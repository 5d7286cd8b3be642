"""OpenAPI 3.1 description of the admin API, served at /api/openapi.json, generated from the schemas that
validate the bodies (gateway/schema.py), so it cannot drift from what the API accepts."""

from __future__ import annotations

from typing import Any

import msgspec

from ..schema import CreateTopic, ErrorBody, PublishBody, PublishReply, RevokeBody, UserDisconnected

_REF = "#/components/schemas/{name}"
_BODIES, _SCHEMAS = msgspec.json.schema_components(
    [CreateTopic, PublishBody, PublishReply, ErrorBody, RevokeBody, UserDisconnected], ref_template=_REF
)
_CREATE, _PUBLISH, _PUBLISHED, _ERROR, _REVOKE, _DISCONNECTED = _BODIES
_OBJECT = {"type": "object"}


def _op(
    summary: str,
    ok: str,
    *,
    body: dict[str, Any] | None = None,
    reply: dict[str, Any] = _OBJECT,
    errors: tuple[int, ...] = (401,),
    params: tuple[str, ...] = (),
) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "security": [{"bearer": []}],
        "responses": {ok: {"description": "OK", "content": {"application/json": {"schema": reply}}}},
    }
    for status in errors:
        op["responses"][str(status)] = {
            "description": "error (codes: docs/protocol.md)",
            "content": {"application/json": {"schema": _ERROR}},
        }
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params]
    return op


def _stream_op() -> dict[str, Any]:
    op = _op(
        "Server-sent events: a JSON snapshot of topics, clients (the busiest 50), rates, counters since start "
        "and histograms every admin.stats_interval_s; 429 beyond admin.stats_max_viewers viewers",
        "200",
        errors=(401, 429),
    )
    op["responses"]["200"]["content"] = {"text/event-stream": {"schema": {"type": "string"}}}
    return op


OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "fanout-gateway admin API", "version": "0.1.0"},
    "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}, "schemas": _SCHEMAS},
    "paths": {
        "/api/topics": {
            "get": _op("List topics", "200"),
            "post": _op("Create a topic", "201", body=_CREATE, errors=(400, 401, 409, 413, 507)),
        },
        "/api/topics/{name}": {
            "get": _op("Describe a topic", "200", errors=(401, 404), params=("name",)),
            "delete": _op("Delete a topic; subscribers get a `closed` entry", "200", errors=(401, 404), params=("name",)),
        },
        "/api/topics/{name}/publish": {
            "post": _op(
                "Publish one or many messages (private topics wait for space, then 503)",
                "200",
                body=_PUBLISH,
                reply=_PUBLISHED,
                errors=(400, 401, 404, 409, 413, 503),
                params=("name",),
            ),
        },
        "/api/topics/{name}/presence": {
            "get": _op(
                "A presence topic's members ({topic, clients, users, members}; members null above "
                "limits.presence_max_members: counts only); 400 when the topic has no presence",
                "200",
                errors=(400, 401, 404),
                params=("name",),
            ),
        },
        "/api/tenants": {
            "get": _op(
                "This node's tenants ([fairness]): weight, connections, users, cost, bytes, frames and messages "
                "served since the start, share of the cost against the weight's share, backlogged; at most 1000",
                "200",
            )
        },
        "/api/clients": {
            "get": _op("List connected clients (with a broker: every node's, at most 1000)", "200", errors=(401, 503))
        },
        "/api/clients/{client_id}": {
            "delete": _op(
                "Disconnect a client, on whichever node holds it (close code 4000)",
                "200",
                errors=(401, 404, 503),
                params=("client_id",),
            ),
        },
        "/api/users/{user}": {
            "delete": _op(
                "Disconnect every connection of a user, on every node (close code 4005)",
                "200",
                reply=_DISCONNECTED,
                errors=(401, 503),
                params=("user",),
            ),
        },
        "/api/revocations": {
            "post": _op(
                "Revoke a token (`jti`) or a user's tokens issued before a time: refused from now on "
                "(`token_revoked`), holders closed with 4010, on every node",
                "201",
                body=_REVOKE,
                errors=(400, 401, 413, 503, 507),
            ),
        },
        "/api/raw/receivers": {"get": _op("Raw TCP receivers", "200", errors=(401, 404))},
        "/api/raw/stats": {"get": _op("Raw TCP broadcaster metrics", "200", errors=(401, 404))},
        "/api/stats": {"get": _op("Core counters and gateway state", "200")},
        "/api/stats/stream": {"get": _stream_op()},
        "/api/rules/{name}": {
            "get": _op(
                "The topic rule a name matches (pattern and settings), as used on first use",
                "200",
                errors=(401, 404),
                params=("name",),
            ),
        },
    },
}
