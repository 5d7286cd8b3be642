"""The pages served at / (the demo page, the dashboard) and the client library any site may load.

`/fanout.js` and `/fanout.d.ts` are meant for pages on other origins: `import { connect } from
"https://gw.example.com/fanout.js"` is a CORS request, which a browser completes only when the answer names
the page's origin. They are answered with `Access-Control-Allow-Origin` for the origins the transports accept
(`server.allowed_origins`; `*` when that is `*`), and with `Cache-Control: no-cache` beside their ETag: a
browser keeps its copy and revalidates it on each load (a 304 while the gateway's library is unchanged), so
a page never runs a library older than the gateway it talks to.
"""

from __future__ import annotations

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

from ..edge.origin import OriginPolicy

#: Files any allowed origin may load (paths relative to the pages' folder).
CLIENT_LIBRARY = frozenset({"fanout.js", "fanout.d.ts", "fossil.js"})


class Pages(StaticFiles):
    def __init__(self, directory: str, policy: OriginPolicy) -> None:
        super().__init__(directory=directory, html=True)
        self.policy = policy

    async def get_response(self, path: str, scope: Scope) -> Response:
        response = await super().get_response(path, scope)
        if path in CLIENT_LIBRARY and response.status_code in (200, 304):
            response.headers["cache-control"] = "no-cache"
            response.headers["vary"] = "Origin"
            headers = Headers(scope=scope)
            origin = headers.get("origin")
            if self.policy.any:
                response.headers["access-control-allow-origin"] = "*"
            elif origin is not None and self.policy.allows(origin, headers.get("host")):
                response.headers["access-control-allow-origin"] = origin
        return response
