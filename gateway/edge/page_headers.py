"""Security headers on every HTTP answer of the app: no framing, no content sniffing.

An ASGI middleware, the outermost of the application's own (gateway/app.py), so that it composes with
whatever a route or the pages set (CORS, ETag, Cache-Control: gateway/admin/pages.py, gateway/edge/origin.py): it only
adds a header the response does not carry already (a response forwarded from another worker carries the
owner's).

- `Content-Security-Policy: frame-ancestors 'none'` and `X-Frame-Options: DENY`: no page of another site
  may frame the dashboard (`/admin/`, clickjacking its kick and publish buttons) or the demo page.
- `X-Content-Type-Options: nosniff`: a JSON answer or a message echoed into one is never run as a script or
  a page.
- `Referrer-Policy: no-referrer`: a page's address (which may carry `?token=`) never leaves in a Referer.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

SECURITY_HEADERS: tuple[tuple[bytes, bytes], ...] = (
    (b"content-security-policy", b"frame-ancestors 'none'"),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
)


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", ()))
                present = {name.lower() for name, _ in headers}
                headers += [h for h in SECURITY_HEADERS if h[0] not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
