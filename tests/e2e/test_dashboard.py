"""The admin dashboard (/admin/) in headless Chromium, driven over the DevTools protocol, against a gateway
with live traffic: tables, rates, the fairness chart, kick and publish. A screenshot is kept as a test
artifact, and copied to docs/img/dashboard.png when SAVE_SCREENSHOTS=1."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import shutil
import threading
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from gateway.testing import run_gateway
from tests import web
from tests.e2e.browser_cdp import CHROMIUM, Chromium, guarded

WINDOW = (1400, 1000)
DOCS_IMG = Path(__file__).resolve().parents[2] / "docs" / "img" / "dashboard.png"
TOPICS = ("prices.eurusd", "chat.lobby", "state.scores")
#: per subscriber, its topics: different sets, so the chart shows different rates
SUBSCRIBERS = (TOPICS, TOPICS[:2], TOPICS[:1], TOPICS[1:])


class Traffic:
    """WebSocket subscribers that read everything, and a publisher thread at a few dozen messages/s."""

    def __init__(self, gw) -> None:
        self.stop = threading.Event()
        self.clients: list[ClientConnection] = []
        self.close_codes: dict[int, int | None] = {}
        self.threads: list[threading.Thread] = []
        self.stack = contextlib.ExitStack()
        for i, topics in enumerate(SUBSCRIBERS):
            ws = self.stack.enter_context(connect(gw.ws_url, open_timeout=5, max_size=None, compression=None))
            for topic in topics:
                ws.send(json.dumps({"op": "subscribe", "topic": topic}))
            self.clients.append(ws)
            self.threads.append(threading.Thread(target=self._read, args=(i, ws), daemon=True))
        self.threads.append(threading.Thread(target=self._publish, args=(gw,), daemon=True))
        for thread in self.threads:
            thread.start()

    def _read(self, i: int, ws: ClientConnection) -> None:
        try:
            while not self.stop.is_set():
                try:
                    ws.recv(timeout=0.5)
                except TimeoutError:
                    pass
        except ConnectionClosed as exc:
            self.close_codes[i] = exc.rcvd.code if exc.rcvd else None

    def _publish(self, gw) -> None:
        with web.Client(base_url=gw.http_url, headers={"Authorization": f"Bearer {gw.admin_token}"}, timeout=10) as http:
            for tick in itertools.count():
                if self.stop.wait(0.1):
                    return
                http.post("/api/topics/prices.eurusd/publish", json={"messages": [{"bid": 1.08 + (tick % 50) / 1e4}] * 5})
                http.post("/api/topics/chat.lobby/publish", json={"data": {"text": f"message {tick}"}})
                if tick % 5 == 0:
                    http.post("/api/topics/state.scores/publish", json={"data": {"home": tick // 5, "away": 0}})

    def close(self) -> None:
        self.stop.set()
        self.stack.close()
        for thread in self.threads:
            thread.join(10)


#: pixels of the chart canvas in a saturated colour: the client lines (the grid, labels and the "others"
#: band are grey-blue)
COLOURED_PIXELS = """(() => {
  const c = document.getElementById('rate-chart');
  const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
  let n = 0;
  for (let i = 0; i < d.length; i += 4)
    if (d[i + 3] > 200 && Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 80) n++;
  return n;
})()"""

LIVE = """(() => {
  const rows = (id) => [...document.querySelectorAll('#' + id + ' tbody tr')];
  const rates = rows('clients').map((tr) => parseFloat(tr.querySelector('td.rate').textContent) || 0);
  const points = +document.getElementById('rate-chart').dataset.points || 0;
  return rows('topics').length === 3 && rows('clients').length === 4 && rates.filter((r) => r > 0).length >= 3
    && points >= 12 && document.getElementById('status').textContent === 'live';
})()"""


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)")
@pytest.mark.timeout(110)
def test_the_dashboard_shows_live_topics_clients_rates_and_the_chart(tmp_path):
    with run_gateway(admin={"stats_interval_s": 0.5}) as gw:
        traffic = Traffic(gw)
        try:
            with Chromium(tmp_path / "profile", window=WINDOW) as browser:
                browser.call("Page.navigate", url=f"{gw.http_url}/admin/#token={gw.admin_token}")
                browser.wait_for(guarded(LIVE), 60, what="three topics, four clients with rates and a chart")
                assert browser.evaluate("location.hash") == ""  # the token left the address bar
                assert browser.evaluate(COLOURED_PIXELS) > 50
                saving = os.environ.get("SAVE_SCREENSHOTS") == "1"
                if saving:  # for the docs: let the chart fill a good part of its window (30 samples)
                    browser.wait_for(
                        guarded("+document.getElementById('rate-chart').dataset.points >= 150"), 60, what="30 samples"
                    )
                shot = tmp_path / "dashboard.png"
                browser.screenshot(shot)
                assert shot.read_bytes().startswith(b"\x89PNG")
                if saving:
                    DOCS_IMG.parent.mkdir(exist_ok=True)
                    shutil.copyfile(shot, DOCS_IMG)
                ids = [
                    c["id"]
                    for c in web.get(f"{gw.http_url}/api/clients", headers={"Authorization": f"Bearer {gw.admin_token}"}).json()[
                        "clients"
                    ]
                ]
                assert len(ids) == 4

                def dom_is_live() -> bool:
                    dom = browser.evaluate("document.documentElement.outerHTML")
                    topics = re.search(r'<table id="topics">.*?</table>', dom, re.S)
                    clients = re.search(r'<table id="clients">.*?</table>', dom, re.S)
                    return bool(
                        topics
                        and clients
                        and all(f"<td>{name}</td>" in topics.group(0) for name in TOPICS)
                        and all(f"<td>{client_id}</td>" in clients.group(0) for client_id in ids)
                        and re.search(r'<td class="num rate">(?!0<)[0-9.]+</td>', clients.group(0))
                    )

                # the DOM as a dump shows it (a sample may fall between two publishes: poll, bounded)
                browser.until(dom_is_live, 30, what="the tables with every topic, every client and a rate above 0")

                def fairness_card() -> bool:  # the share index (0.000-1.000), the clients counted, the lowest share
                    jain = browser.evaluate("document.getElementById('c-jain').textContent")
                    spread = browser.evaluate("document.getElementById('c-spread').textContent")
                    return bool(re.fullmatch(r"[01]\.\d{3}", jain) and re.match(r"\d+ clients, lowest share [01]\.\d\d", spread))

                browser.until(fairness_card, 30, what="the fairness card")

                # publish through the form, then kick the client of one topic with its button
                browser.evaluate("""(() => {
                  document.getElementById('pub-topic').value = 'state.scores';
                  document.getElementById('pub-data').value = '{"home": 99}';
                  document.getElementById('publish').requestSubmit(); })()""")
                browser.wait_for(
                    guarded("document.getElementById('pub-result').textContent.startsWith('published to state.scores')"),
                    what="the publish answer",
                )
                victim = ids[0]
                browser.evaluate(
                    f"window.confirm = () => true; document.querySelector('#clients tr[data-client=\"{victim}\"] button').click()"
                )
                browser.wait_for(
                    guarded(f"!document.querySelector('#clients tr[data-client=\"{victim}\"]')"),
                    what="the kicked client to leave the table",
                )
                assert browser.errors == []
        finally:
            traffic.close()
    assert 4000 in traffic.close_codes.values()  # the kicked one, closed with the admin's code
