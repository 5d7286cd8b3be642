"""static/fanout.js and a draining gateway, under Node with a stand-in WebSocket: close 1012 "restarting:
reconnect in N ms" (and an SSE / long-poll close with `retry_ms`) makes the client wait N ms (at most
backoffMaxMs) before reconnecting, instead of its quick backoff (docs/client.md)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="needs node")

SCRIPT = """
const { connect, restartHintMs } = await import(process.argv[1]);
const hints = [restartHintMs(1012, "restarting: reconnect in 1234 ms"), restartHintMs(1012, "x", 250),
               restartHintMs(1001, "restarting: reconnect in 5 ms"), restartHintMs(1012, "Service Restart")];
const opened = [];
globalThis.WebSocket = class {
  constructor(url) {
    this.readyState = 0;
    opened.push(Date.now());
    const first = opened.length === 1;
    setTimeout(() => {
      this.readyState = 1;
      this.onopen?.();
      if (first) setTimeout(() => { this.readyState = 3; this.onclose?.({ code: 1012, reason: HINT }); }, 20);
    }, 5);
  }
  send() {}
  close() { this.readyState = 3; }
};
const HINT = process.argv[2];
const client = connect("http://gw.invalid", { transports: ["ws"], backoffBaseMs: 10, backoffMaxMs: Number(process.argv[3]) });
await new Promise((resolve) => { const t = setInterval(() => { if (opened.length >= 2) { clearInterval(t); resolve(); } }, 5); });
client.close();
console.log(JSON.stringify({ hints, gap: opened[1] - opened[0] }));
process.exit(0);
"""


def run_node(hint: str, backoff_max_ms: int) -> dict:
    out = subprocess.run(
        ["node", "--input-type=module", "-e", SCRIPT, (ROOT / "static" / "fanout.js").as_uri(), hint, str(backoff_max_ms)],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_1012_hint_delays_the_reconnect_and_is_capped_by_backoff_max() -> None:
    result = run_node("restarting: reconnect in 600 ms", 15000)
    assert result["hints"] == [1234, 250, None, None]
    assert 600 <= result["gap"] < 1500, result  # 20 ms open + the 600 ms hint; without it: at most 10 ms
    capped = run_node("restarting: reconnect in 60000 ms", 300)
    assert 300 <= capped["gap"] < 1200, capped


LP_SCRIPT = """
const { connect } = await import(process.argv[1]);
const sessions = [];
let polls = 0;
globalThis.fetch = async (url, init = {}) => {
  const path = new URL(url).pathname;
  const answer = (status, body) => ({ status, ok: status < 300, json: async () => body });
  if (init.method === "POST" && path === "/lp") {
    sessions.push(Date.now());
    return answer(201, { session: `s${sessions.length}`, client_id: `lp-${sessions.length}` });
  }
  if (init.method === "POST") return answer(202, { accepted: 1 });
  if (init.method === "DELETE") return answer(204, null);
  polls++;
  if (path === "/lp/s1" && polls === 1) {
    await new Promise((r) => setTimeout(r, 20));
    return answer(200, { batch: null, entries: [{ type: "error", code: "closed", close_code: 1012,
      message: "restarting: reconnect in 1 ms", retry_ms: Number(process.argv[2]) }] });
  }
  await new Promise((r, reject) => {
    const t = setTimeout(r, 5000);
    init.signal?.addEventListener("abort", () => { clearTimeout(t); reject(new Error("aborted")); });
  });
  return answer(200, { batch: null, entries: [] });
};
const client = connect("http://gw.invalid", { transports: ["lp"], backoffBaseMs: 10, backoffMaxMs: 15000 });
await new Promise((resolve) => {
  const t = setInterval(() => { if (sessions.length >= 2) { clearInterval(t); resolve(); } }, 5);
});
client.close();
console.log(JSON.stringify({ gap: sessions[1] - sessions[0] }));
process.exit(0);
"""


def test_a_long_poll_closed_entry_with_retry_ms_delays_the_reconnect() -> None:
    """`retry_ms` of the entry wins over the reason's text (which says 1 ms here)."""
    out = subprocess.run(
        ["node", "--input-type=module", "-e", LP_SCRIPT, (ROOT / "static" / "fanout.js").as_uri(), "500"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    gap = json.loads(out.stdout.strip().splitlines()[-1])["gap"]
    assert 500 <= gap < 1500, gap


ZERO_HINT_SCRIPT = """
const { connect } = await import(process.argv[1]);
let opened = 0;
globalThis.WebSocket = class {
  constructor(url) {
    this.readyState = 0;
    opened++;
    setTimeout(() => {
      this.readyState = 1;
      this.onopen?.();
      setTimeout(() => { this.readyState = 3; this.onclose?.({ code: 1012, reason: "restarting: reconnect in 0 ms" }); }, 1);
    }, 1);
  }
  send() {}
  close() { this.readyState = 3; }
};
const client = connect("http://gw.invalid", { transports: ["ws"], backoffBaseMs: 50, backoffMaxMs: 15000 });
await new Promise((resolve) => setTimeout(resolve, 2000));
client.close();
console.log(JSON.stringify({ opened }));
process.exit(0);
"""


def test_a_gateway_closing_1012_reconnect_in_0_ms_at_once_meets_a_growing_backoff() -> None:
    # a hint only lengthens the delay: every attempt still counts, so the full-jitter cap doubles each time
    out = subprocess.run(
        ["node", "--input-type=module", "-e", ZERO_HINT_SCRIPT, (ROOT / "static" / "fanout.js").as_uri()],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode == 0, out.stderr
    opened = json.loads(out.stdout.strip().splitlines()[-1])["opened"]
    assert opened <= 12, opened  # without the backoff: hundreds in 2 s
