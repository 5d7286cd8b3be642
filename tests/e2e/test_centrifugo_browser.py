"""centrifuge-js's browser build (its `dist/centrifuge.js`, JSON) in Debian's headless Chromium against the
gateway's /connection/websocket (docs/centrifugo.md, "Client protocol"): connect, subscribe, publications
from the server API in order with offset = seq + 1, a client publish and an rpc. The bundle comes from
tests/centrifugo_js (pinned; `make test` installs it)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.testing import run_gateway
from tests import web
from tests.e2e.browser_cdp import CHROMIUM, Chromium

BUNDLE = Path(__file__).resolve().parents[1] / "centrifugo_js" / "node_modules" / "centrifuge" / "dist" / "centrifuge.js"

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)"),
    pytest.mark.skipif(not BUNDLE.is_file(), reason="tests/centrifugo_js/node_modules (make test installs it)"),
    pytest.mark.timeout(90),
]

PAGE = """<!doctype html><meta charset="utf-8"><title>centrifuge-js</title>
<script src="centrifuge.js"></script>
<script>
window.rec = {pubs: [], subscribed: [], connected: 0, errors: []};
window.start = async (channel) => {
  const c = new Centrifuge(`ws://${location.host}/connection/websocket`);
  c.on('connected', () => { rec.connected += 1; });
  const sub = c.newSubscription(channel, {recoverable: true});
  sub.on('publication', (ctx) => rec.pubs.push([ctx.offset, ctx.data]));
  sub.on('subscribed', (ctx) => rec.subscribed.push(ctx.recovered));
  sub.on('error', (ctx) => rec.errors.push(ctx.error.code));
  sub.subscribe();
  c.connect();
  window.client = c;
  return true;
};
window.harnessReady = true;
</script>
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("centrifugo-site")
    shutil.copy(BUNDLE, root / "centrifuge.js")
    (root / "centrifuge.html").write_text(PAGE)
    return root


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Chromium]:
    with Chromium(tmp_path_factory.mktemp("chromium")) as chromium:
        yield chromium


def test_the_browser_build_subscribes_receives_publishes_and_calls(site: Path, browser: Chromium) -> None:
    rules = {"rules": [{"pattern": "*", "kind": "ring", "anonymous": True, "client_publish": True}]}
    with run_gateway(server={"static_dir": str(site)}, topics=rules) as gw:
        browser.open(f"{gw.http_url}/centrifuge.html")
        browser.evaluate("start('news')")
        browser.wait_for("rec.subscribed.length === 1", what="subscribed", dump="JSON.stringify(rec)")
        for n in range(3):
            answer = web.post(
                f"{gw.http_url}/api/publish",
                json={"channel": "news", "data": {"n": n}},
                headers={"X-API-Key": gw.admin_token},
                trust_env=False,
            )
            assert answer.json()["result"]["offset"] == n + 1
        browser.evaluate("client.publish('news', {n: 'mine'})")
        browser.wait_for("rec.pubs.length === 4", what="4 publications", dump="JSON.stringify(rec)")
        assert browser.evaluate("rec.pubs") == [[1, {"n": 0}], [2, {"n": 1}], [3, {"n": 2}], [4, {"n": "mine"}]]
        assert browser.evaluate("client.rpc('echo', {a: 1}).then((r) => r.data)") == {"a": 1}
        assert browser.evaluate("rec.connected") == 1 and browser.evaluate("rec.errors") == []
        assert browser.errors == []
