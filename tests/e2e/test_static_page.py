"""The page at / in headless Chromium (Debian's chromium): it connects, subscribes and shows messages."""

import re
import shutil
import subprocess

import httpx
import pytest

from gateway.testing import run_gateway

CHROMIUM = shutil.which("chromium")
# Flags from the machine's notes: without the background-networking ones Chromium keeps dialling out.
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (make test installs it)")
@pytest.mark.timeout(90)
def test_the_page_subscribes_and_shows_the_state_of_the_world(tmp_path):
    with run_gateway() as gw:
        headers = {"Authorization": f"Bearer {gw.admin_token}"}
        r = httpx.post(f"{gw.http_url}/api/topics/state.demo/publish", json={"data": {"text": "hello-page"}}, headers=headers)
        assert r.status_code == 200
        page = subprocess.run(
            [CHROMIUM, *FLAGS, f"--user-data-dir={tmp_path}", "--virtual-time-budget=5000", "--dump-dom",
             f"{gw.http_url}/?topic=state.demo"],
            capture_output=True, text=True, timeout=60,
        )
    dom = page.stdout
    assert re.search(r'<span id="status">connected</span>', dom), page.stderr[-2000:]
    log = re.search(r'<div id="log">(.*?)</div></div>', dom, re.S)
    assert log, dom[-2000:]
    assert '"type":"subscribed","topic":"state.demo","kind":"snapshot"' in log.group(1)
    assert 'state.demo #0: {"text":"hello-page"}' in log.group(1)
