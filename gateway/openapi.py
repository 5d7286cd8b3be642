"""OpenAPI 3.1 description of the admin API, served at /api/openapi.json."""

_ERROR = {"$ref": "#/components/schemas/Error"}


def _op(summary: str, ok: str, *, body: dict | None = None, errors: tuple[int, ...] = (401,), params: tuple = ()) -> dict:
    op: dict = {
        "summary": summary,
        "security": [{"bearer": []}],
        "responses": {ok: {"description": "OK", "content": {"application/json": {"schema": {"type": "object"}}}}},
    }
    for status in errors:
        op["responses"][str(status)] = {"description": "error", "content": {"application/json": {"schema": _ERROR}}}
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if params:
        op["parameters"] = [{"name": p, "in": "path", "required": True, "schema": {"type": "string"}} for p in params]
    return op


TOPIC_SETTINGS = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "kind": {"enum": ["ring", "snapshot", "private"]},
        "capacity": {"type": "integer", "minimum": 1},
        "batch_depth": {"type": "integer", "minimum": 1},
        "reorder_window": {"type": "integer", "minimum": 1},
        "hole_timeout": {"type": "number", "exclusiveMinimum": 0},
        "max_count": {"type": "integer", "minimum": 1},
        "max_bytes": {"type": "integer", "minimum": 1},
        "client_publish": {"type": "boolean"},
    },
    "additionalProperties": False,
}

PUBLISH = {
    "type": "object",
    "properties": {
        "data": {},
        "messages": {"type": "array"},
        "client": {"type": "string", "description": "target client of a private topic"},
        "seq": {"type": "integer", "minimum": 0, "description": "explicit seq (out-of-order producers)"},
    },
}

OPENAPI = {
    "openapi": "3.1.0",
    "info": {"title": "fanout-gateway admin API", "version": "0.1.0"},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {
                "type": "object",
                "required": ["error"],
                "properties": {"error": {"type": "object", "required": ["code", "message"],
                                         "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}},
            }
        },
    },
    "paths": {
        "/api/topics": {
            "get": _op("List topics", "200"),
            "post": _op("Create a topic", "201", body=TOPIC_SETTINGS, errors=(400, 401, 409, 507)),
        },
        "/api/topics/{name}": {
            "get": _op("Describe a topic", "200", errors=(401, 404), params=("name",)),
            "delete": _op("Delete a topic; subscribers get a `closed` entry", "200", errors=(401, 404), params=("name",)),
        },
        "/api/topics/{name}/publish": {
            "post": _op("Publish one or many messages (private topics wait for space, then 503)", "200",
                        body=PUBLISH, errors=(400, 401, 404, 409, 413, 503), params=("name",)),
        },
        "/api/clients": {"get": _op("List connected clients", "200")},
        "/api/clients/{client_id}": {
            "delete": _op("Disconnect a client (close code 4000)", "200", errors=(401, 404), params=("client_id",)),
        },
        "/api/raw/receivers": {"get": _op("Raw TCP receivers", "200", errors=(401, 404))},
        "/api/raw/stats": {"get": _op("Raw TCP broadcaster metrics (seed 003 §9)", "200", errors=(401, 404))},
        "/api/stats": {"get": _op("Core counters and gateway state", "200")},
    },
}
