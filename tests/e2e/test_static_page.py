"""The demo page at / (static/index.html, built on static/fanout.js) in headless Chromium (Debian's chromium):
it connects, subscribes, shows messages, and publishes; `?transports=` picks the transport."""

import json
import re

import pytest

from gateway.testing import run_gateway
from tests import web
from tests.e2e.browser_cdp import CHROMIUM, Chromium

pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)")


@pytest.fixture(scope="module")
def gw():
    """One gateway for the module's pages: each test on a topic of its own."""
    with run_gateway() as handle:
        yield handle


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """One browser: each test opens its page in it (`open` waits for the new document)."""
    with Chromium(tmp_path_factory.mktemp("chromium")) as chromium:
        yield chromium


@pytest.mark.timeout(90)
def test_the_page_subscribes_and_shows_the_state_of_the_world(gw, browser):
    headers = {"Authorization": f"Bearer {gw.admin_token}"}
    r = web.post(f"{gw.http_url}/api/topics/state.demo/publish", json={"data": {"text": "hello-page"}}, headers=headers)
    assert r.status_code == 200
    assert web.get(f"{gw.http_url}/fanout.js").headers["content-type"].startswith(("text/javascript", "application/javascript"))
    # polled with a real deadline (a --virtual-time-budget can run out before a handshake on a loaded machine)
    browser.open(f"{gw.http_url}/?topic=state.demo", ready="document.getElementById('log').textContent.includes('state.demo #0')")
    dom = browser.evaluate("document.documentElement.outerHTML")
    spans = re.findall(r'<span id="\w+">[^<]*</span>', dom)
    assert '<span id="status">connected</span>' in spans, spans
    assert '<span id="transport">ws</span>' in spans, spans
    log = re.search(r'<div id="log">(.*?)</div>\s*<script', dom, re.S)
    assert log, dom[-2000:]
    assert re.search(r"subscribed state\.demo \(snapshot, epoch [0-9a-f]+-\d+, from #0, over ws\)", log.group(1))
    assert 'state.demo #0: {"text":"hello-page"}' in log.group(1)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("transport", ["sse", "lp"])
def test_the_page_publishes_over_the_transport_it_is_given(gw, browser, transport):
    topic = f"chat.page-{transport}"
    browser.open(
        f"{gw.http_url}/?topic={topic}&transports={transport}",
        ready="document.getElementById('status').textContent === 'connected'",
    )
    assert browser.evaluate("document.getElementById('transport').textContent") == transport
    browser.wait_for(f"document.getElementById('log').textContent.includes('subscribed {topic}')")
    browser.evaluate(
        "document.getElementById('text').value = 'hi from the form';document.querySelector('#pub button').click(); true"
    )
    line = f'{topic} #0: {{"text":"hi from the form"}}'
    browser.wait_for(
        f"document.getElementById('log').textContent.includes({json.dumps(line)})", what="the published message to come back"
    )
    assert "published #0" in browser.evaluate("document.getElementById('log').textContent")
    assert browser.evaluate("document.getElementById('losses').textContent") == "0"
