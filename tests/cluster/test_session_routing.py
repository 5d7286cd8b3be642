"""Long-poll and SSE sessions with `server.workers = 2` (docs/cluster.md §5): every request of a session goes
over a fresh TCP connection, so the kernel spreads them over both workers, and the one that does not hold
the session forwards it to the one that does (gateway/workers/forward.py). 30+ connections per test: the
chance that all land on the owner is below 2**-29. The last test plays the owner itself (a fake worker on the
forwarder's inbox, tests/gateway/test_forward_upstream.py has more) and answers it arbitrary response heads."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.workers.forward import owner_of
from tests.cluster.cluster_helpers import http
from tests.gateway.test_forward_upstream import answer, run, run_forward

#: a long poll returns this soon when nothing comes (the forwarder waits for it plus its own margin)
POLL_S = 2.0


@pytest.fixture(scope="module")
def node(module_nodes):
    """One two-worker gateway for the module: each test makes sessions and topics of its own."""
    return module_nodes.start("w", server={"workers": 2}, longpoll={"poll_timeout_s": POLL_S})


def fresh(method: str, url: str, **kwargs) -> httpx.Response:
    """One request on a new connection (the helpers' client keeps none open)."""
    return http().request(method, url, timeout=POLL_S + 10, **kwargs)


def test_owner_of_reads_the_worker_index_of_session_paths_only():
    assert owner_of("/lp/w1.abc_-") == 1 and owner_of("/sse/w0.x") == 0 and owner_of("/lp/w12.") == 12
    for path in ("/lp/abc", "/lp", "/lp/w1.abc/x", "/ws/w1.abc", "/lp/wx.abc", "/lp/w12345.abc", "/api/w1.x"):
        assert owner_of(path) is None, path


def test_a_long_poll_session_works_over_fresh_connections_to_both_workers(node):
    secrets = [fresh("POST", f"{node.http_url}/lp").json()["session"] for _ in range(12)]
    # sessions are made by both workers (2**-11 chance otherwise), each named by its owner
    assert {s.split(".", 1)[0] for s in secrets} == {"w0", "w1"}
    for secret in secrets[1:]:
        assert fresh("DELETE", f"{node.http_url}/lp/{secret}").status_code == 204
    url = f"{node.http_url}/lp/{secrets[0]}"
    assert fresh("POST", url, json={"op": "subscribe", "topic": "lp", "id": "s"}).json() == {"accepted": 1}
    got: list[dict] = []
    ack = None

    def poll() -> None:
        nonlocal ack
        reply = fresh("GET", url, params={} if ack is None else {"ack": ack})
        assert reply.status_code == 200, reply.text
        body = reply.json()
        if body["batch"] is not None:
            ack = body["batch"]
        got.extend(body["entries"])

    poll()
    assert any(e["type"] == "subscribed" and e.get("id") == "s" for e in got), got
    for i in range(15):  # each publish, command and poll on a new connection
        assert node.publish("lp", {"i": i}).status_code == 200
        assert fresh("POST", url, json=[{"op": "ping", "id": f"p{i}"}]).status_code == 202
        deadline = time.monotonic() + 10
        while not any(e.get("id") == f"p{i}" for e in got) or sum(e["type"] == "msg" for e in got) <= i:
            assert time.monotonic() < deadline, got[-5:]
            poll()
    msgs = [e for e in got if e["type"] == "msg"]
    assert [e["data"]["i"] for e in msgs] == list(range(15))  # every one, once, in order
    assert [e["seq"] for e in msgs] == list(range(15))
    assert [e["id"] for e in got if e["type"] == "pong" or e.get("id", "").startswith("p")] == [f"p{i}" for i in range(15)]
    assert fresh("DELETE", url).status_code == 204
    for _ in range(4):  # gone, whichever worker is asked
        reply = fresh("GET", url)
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "unknown_session"


def sse_events(lines: Iterator[str]) -> Iterator[tuple[str, str]]:
    """(event, data) of an SSE stream's lines; comments (pings) skipped."""
    event, data = "message", ""
    for line in lines:
        if line == "":
            if data:
                yield event, data
            event, data = "message", ""
        elif line.startswith("event: "):
            event = line[7:]
        elif line.startswith("data: "):
            data = line[6:]


def test_sse_commands_over_fresh_connections_reach_the_stream_on_its_worker(node):
    with httpx.Client(timeout=httpx.Timeout(10.0)) as client, client.stream("GET", f"{node.http_url}/sse") as stream:
        assert stream.status_code == 200
        events = sse_events(stream.iter_lines())
        kind, data = next(events)
        assert kind == "session"
        secret = json.loads(data)["session"]
        assert owner_of(f"/sse/{secret}") in (0, 1)
        url = f"{node.http_url}/sse/{secret}"
        entries: list[dict] = []

        def read_until(done) -> None:
            while not done():
                kind, data = next(events)
                assert kind == "message", (kind, data)
                entries.extend(json.loads(data))

        assert fresh("POST", url, json={"op": "subscribe", "topic": "sse", "id": "s"}).status_code == 202
        read_until(lambda: any(e.get("id") == "s" for e in entries))
        for i in range(15):  # client publishes and pings, each on a new connection
            reply = fresh("POST", url, json={"op": "publish", "topic": "sse", "data": i, "id": f"m{i}"})
            assert reply.json() == {"accepted": 1}, reply.text
            assert fresh("POST", url, json={"op": "ping", "id": f"p{i}"}).status_code == 202
        read_until(
            lambda: (
                sum(e["type"] == "msg" for e in entries) >= 15
                and all(any(e.get("id") == f"{k}{i}" for e in entries) for i in range(15) for k in "mp")
            )
        )
        msgs = [e for e in entries if e["type"] == "msg"]
        assert [e["data"] for e in msgs] == list(range(15)) and [e["seq"] for e in msgs] == list(range(15))
        assert sorted(e["result"]["seq"] for e in entries if e.get("id", "").startswith("m")) == list(range(15))
        assert fresh("DELETE", url).status_code == 204
        kind, data = next(events)
        assert kind == "close" and json.loads(data)["code"] == 1000
    for _ in range(4):
        reply = fresh("POST", url, json={"op": "ping"})
        assert reply.status_code == 404 and reply.json()["error"]["code"] == "unknown_session"


def test_unknown_secrets_and_missing_workers_get_404_and_bodies_keep_their_bound(node):
    for _ in range(6):  # some land on each worker: forwarded or not, the answer is the same
        for path in (
            "/lp/nonsense",
            "/lp/w0.nonsense",
            "/lp/w1.nonsense",
            "/lp/w2.nonsense",
            "/lp/w9999.x",
            "/sse/w1.nonsense",
            "/sse/w7.nonsense",
        ):
            method = "GET" if path.startswith("/lp") else "POST"
            reply = fresh(method, node.http_url + path, json={"op": "ping"} if method == "POST" else None)
            assert reply.status_code == 404, (path, reply.text)
            assert reply.json()["error"]["code"] == "unknown_session", (path, reply.text)
    secret = fresh("POST", f"{node.http_url}/lp").json()["session"]
    big = b'"' + b"x" * 70000 + b'"'  # above longpoll.max_body_bytes (65536)
    for _ in range(6):
        reply = fresh("POST", f"{node.http_url}/lp/{secret}", content=big, headers={"content-type": "application/json"})
        assert reply.status_code == 413 and reply.json()["error"]["code"] == "too_large", reply.text


def test_a_forwarded_poll_whose_client_leaves_does_not_hold_the_session(node):
    """Polls that the client abandons (read timeout) on either worker; the session still answers after."""
    secret = fresh("POST", f"{node.http_url}/lp").json()["session"]
    url = f"{node.http_url}/lp/{secret}"
    for _ in range(6):
        with pytest.raises(httpx.ReadTimeout):
            httpx.get(url, timeout=httpx.Timeout(10.0, read=0.3))
    assert fresh("POST", url, json={"op": "subscribe", "topic": "left", "id": "s"}).status_code == 202
    reply = fresh("GET", url)
    assert reply.status_code == 200 and any(e.get("id") == "s" for e in reply.json()["entries"])


#: response headers the forwarder never passes on (hop-by-hop, uvicorn's own, the owner's CORS headers)
NOT_RELAYED = {
    b"connection",
    b"keep-alive",
    b"transfer-encoding",
    b"trailer",
    b"date",
    b"server",
    b"vary",
    b"access-control-allow-origin",
    b"access-control-expose-headers",
}


#: heads that h11 may well parse: a status, a reason, header lines of names that matter here
_header_lines = st.lists(
    st.builds(
        lambda name, value: b"\r\n" + name + b": " + value,
        st.sampled_from(
            [
                b"connection",
                b"date",
                b"content-length",
                b"Transfer-Encoding",
                b"vary",
                b"x-a",
                b"Content-Type",
                b"access-control-allow-origin",
                b"bad name",
                b"server",
            ]
        ),
        st.sampled_from([b"close", b"0", b"chunked", b"5", b"", b"x y", b"-1"]) | st.binary(max_size=8),
    ),
    max_size=6,
)
_heads = st.binary(max_size=300) | st.builds(
    lambda status, reason, lines: status + reason + b"".join(lines),
    st.sampled_from([b"200", b"204", b"304", b"404", b"500", b"100", b"101", b"099", b"1000", b"2x0"]),
    st.sampled_from([b" OK", b"", b" ", b"  two spaces"]) | st.binary(max_size=12),
    _header_lines,
)


@given(_heads)
@settings(max_examples=300, deadline=None)
def test_any_response_head_from_a_worker_is_relayed_or_answered_500_internal_error(data):
    response = b"HTTP/1.1 " + data + b"\r\n\r\n"
    got = run(run_forward(answer(response)))
    assert got.ended  # never an exception out of the router, never a response left open
    headers = got.headers
    if got.status == 500 and headers.get(b"content-type") == b"application/json" and got.body.startswith(b'{"error"'):
        error = got.error()  # the documented answer when the owner's response is not HTTP/1.1 (docs/cluster.md §5)
        assert error["code"] == "internal_error"
        assert error["message"].startswith("the worker holding this session did not answer")
        return
    assert 200 <= got.status <= 999 and data[:3] == b"%d" % got.status  # the owner's own status, relayed
    assert not NOT_RELAYED & set(headers)
    # a body is what follows the head (h11 also ends lines at a bare LF), or ends short of what it announced
    assert response.endswith(got.body) and len(got.body) < len(data)
