"""A page on another origin loads the client library from the gateway and receives messages (Chromium).

The page is served by a plain HTTP server on another port of 127.0.0.1, so its origin differs from the
gateway's; it imports `http://127.0.0.1:GATEWAY/fanout.js` as a module (a CORS request) and connects. With the
page's origin in `server.allowed_origins` it works; with it left out the browser refuses the module.
"""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from gateway.testing import GatewayHandle, run_gateway
from tests import web
from tests.e2e.browser_cdp import CHROMIUM, Chromium

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)"),
    pytest.mark.timeout(90),
]

PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>another site</title></head><body>
<script type="module">
window.rec = [];
window.failed = null;
import("GATEWAY/fanout.js").then(({ connect }) => {
  const client = connect("GATEWAY");
  const sub = client.subscribe("chat.cross");
  sub.on("subscribed", () => { window.subscribed = true; });
  sub.on("message", ({ seq, data }) => window.rec.push([seq, data]));
  window.harnessReady = true;
}, (error) => { window.failed = String(error); window.harnessReady = true; });
</script></body></html>
"""


@contextmanager
def site(root: Path) -> Iterator[str]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    with Chromium(tmp_path_factory.mktemp("chromium")) as chromium:
        yield chromium


def test_a_page_of_an_allowed_origin_imports_the_library_and_receives(tmp_path: Path, browser: Chromium) -> None:
    with site(tmp_path) as origin, run_gateway(server={"allowed_origins": [origin]}) as gw:
        (tmp_path / "index.html").write_text(PAGE.replace("GATEWAY", gw.http_url))
        browser.open(f"{origin}/index.html")
        assert browser.evaluate("window.failed") is None
        browser.wait_for("window.subscribed === true", what="subscribed")
        _publish(gw, [{"n": n} for n in range(5)])
        browser.wait_for("window.rec.length >= 5", what="5 messages", dump="JSON.stringify(window.rec)")
        assert browser.evaluate("window.rec") == [[n, {"n": n}] for n in range(5)]


def test_a_page_of_another_origin_cannot_import_it_unless_allowed(tmp_path: Path, browser: Chromium) -> None:
    with site(tmp_path) as origin, run_gateway() as gw:
        (tmp_path / "index.html").write_text(PAGE.replace("GATEWAY", gw.http_url))
        browser.open(f"{origin}/index.html")
        assert "fanout.js" in (browser.evaluate("window.failed") or "")


def _publish(gw: GatewayHandle, messages: list) -> None:
    r = web.post(
        f"{gw.http_url}/api/topics/chat.cross/publish",
        json={"messages": messages},
        headers={"Authorization": f"Bearer {gw.admin_token}"},
        timeout=10,
    )
    assert r.status_code == 200, r.text
