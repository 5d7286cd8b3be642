"""A long Redis outage (hardening round 4, item 16): however many reconnect attempts failed, a node is ready
again within a bound once Redis serves, and it says so in one line, with how long Redis was unavailable.

"Long" is counted in failed attempts, not in minutes. What an outage's length changes is the number of
reconnect attempts the node makes against it, and each attempt used to close every connection of the command
pool, including one the readiness probe was using or taking at that moment: redis-py then writes on a stream
it has just set to None and raises AttributeError, which the probe did not catch, so the probe task ended in
silence and /readyz stayed 503 `broker_unavailable` for good. The race needs pool connections that stay
connected while the attempts fail: a Redis that accepts connections but refuses commands (one loading its
data after a restart answers `-LOADING` to everything). Here Redis refuses this node's commands through an
ACL, which answers at once, and the link's pauses are set to zero, so a few seconds hold the thousands of
failed attempts of a long outage (before the fix the probe died within half a second, every run).

The in-process tests run the real link (gateway/broker/link.py) on a real redis-server, with the link's
timing knobs set small; the last one runs a real gateway with two workers through an outage of a dozen
attempts each: per worker one line when Redis became unavailable, one when it is back (with the seconds),
none per attempt."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Awaitable, Callable

import httpx

from gateway.broker import link
from gateway.broker.stopping import stop_tasks
from gateway.config import BrokerConfig

#: the node's Redis user in the in-process tests: a test refuses its commands (ACL) while the default user
#: (the test's own commands, `RedisServer.command`) keeps every right
USER, PASSWORD = "gw", "gw-secret"
#: /readyz is ready again within this of Redis serving (docs/operations.md, "readiness"): the pause before the
#: next attempt (link.RETRY_S, 0 here) plus one attempt, whatever the probe's period
READY_WITHIN_S = 1.0
#: failed reconnect attempts that make an outage long (before the fix the probe died within a few hundred)
LONG_OUTAGE = 500
DOWN = re.compile(r" unavailable \((lost|silent): ")
BACK = re.compile(r" back after (\d+\.\d) s unavailable \((\d+) failed reconnects\)")


def fast_link(monkeypatch, redis_server) -> str:
    """The link's knobs set small (attempts without pause, a probe every millisecond) and a Redis user for the
    node; its URL."""
    monkeypatch.setattr(link, "RETRY_S", 0.0)
    monkeypatch.setattr(link, "PROBE_PERIOD_S", 0.001)
    monkeypatch.setattr(link, "PROBE_TIMEOUT_S", 0.2)
    monkeypatch.setattr(link, "COMMAND_TIMEOUT_S", 1.0)
    assert redis_server.command("ACL", "SETUSER", USER, "on", f">{PASSWORD}", "+@all", "~*", "&*") == "+OK"
    return f"redis://{USER}:{PASSWORD}@127.0.0.1:{redis_server.port}/0"


def refuse(redis_server, refused: bool) -> None:
    """Redis refuses every command of the node (and drops its connections, the channel one too), or serves."""
    assert redis_server.command("ACL", "SETUSER", USER, "-@all" if refused else "+@all") == "+OK"
    if refused:
        assert redis_server.command("CLIENT", "KILL", "USER", USER).startswith(":")


async def until(condition: Callable[[], bool], timeout: float) -> float | None:
    """Seconds until `condition` held (polled every 5 ms), None if it did not within `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if condition():
            return time.monotonic() - start
        await asyncio.sleep(0.005)
    return None


async def with_link(
    url: str,
    body: Callable[[link.SingleLink, list[asyncio.Task[None]]], Awaitable[object]],
    reconnected: Callable[[], Awaitable[None]] | None = None,
) -> object:
    """Connect a SingleLink, run its reader and probe, await `body(link, tasks)`, stop."""

    async def checked() -> None:
        pass

    node = link.SingleLink(
        BrokerConfig(
            url=url,
            sentinel_addresses=[],
            sentinel_master="",
            cluster_addresses=[],
            prefix="lo",
            history_ttl_s=60.0,
            connect_timeout_s=5.0,
            max_topics=0,
            max_pending_bytes=0,
        ),
        link.LinkHooks(
            message=lambda channel, payload: None,
            lost=lambda: None,
            channels=lambda: ["lo:control"],
            reconnected=reconnected or checked,
            back=lambda: None,
        ),
    )
    await node.connect(5.0)
    tasks = node.run()
    try:
        await node.subscribe_channels(["lo:control"])
        assert node.healthy
        return await body(node, tasks)
    finally:
        await stop_tasks(tasks)  # the broker's own stop
        await node.close()


def ended(tasks: list[asyncio.Task[None]]) -> list[tuple[str, str]]:
    return [(task.get_name(), repr(task.exception())) for task in tasks if task.done()]


def broker_lines(caplog, level: int = logging.WARNING) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "gateway.broker" and r.levelno >= level]


def test_readiness_comes_back_after_thousands_of_failed_reconnects(redis_server, monkeypatch, caplog):
    url = fast_link(monkeypatch, redis_server)
    caplog.set_level("WARNING", logger="gateway.broker")

    async def outage(node: link.SingleLink, tasks: list[asyncio.Task[None]]) -> tuple[int, float, float | None, list]:
        refuse(redis_server, True)
        # a long outage counts in attempts: at least LONG_OUTAGE of them, however long a loaded machine takes
        # to make them (a quiet one makes thousands in 3 s; one at load 7 made 119-432)
        began = time.monotonic()
        deadline = began + 3.0
        while time.monotonic() < deadline or node.reconnect_failures < LONG_OUTAGE and time.monotonic() < began + 30:
            if any(task.done() for task in tasks):
                break
            await asyncio.sleep(0.05)
        outage_s = time.monotonic() - began
        failed = node.reconnect_failures
        assert not node.healthy
        # from now on the probe waits 30 s between PINGs: ready again must not wait for it
        monkeypatch.setattr(link, "PROBE_PERIOD_S", 30.0)
        refuse(redis_server, False)
        return failed, outage_s, await until(lambda: node.healthy, 5.0), ended(tasks)

    failed, outage_s, ready_after, died = asyncio.run(with_link(url, outage))
    assert not died, f"link tasks ended during the outage: {died}"
    assert failed >= LONG_OUTAGE, failed  # a long outage, in attempts
    assert ready_after is not None, "not ready 5 s after Redis served again"
    assert ready_after < READY_WITHIN_S, ready_after
    lines = broker_lines(caplog)
    assert not [m for m in lines if "unexpectedly" in m], lines  # the race is gone, not only survived
    assert len([m for m in lines if DOWN.search(m)]) == 1 and len([m for m in lines if BACK.search(m)]) == 1, lines
    print(
        f"\n{failed} failed reconnects in {outage_s:.1f} s; ready {ready_after:.3f} s after Redis served again;"
        f" {[m for m in lines if BACK.search(m)][0]}"
    )


def test_a_reconnect_that_fails_with_no_redis_error_is_retried_and_told_once(redis_server, monkeypatch, caplog):
    url = fast_link(monkeypatch, redis_server)
    caplog.set_level("WARNING", logger="gateway.broker")
    checks = 0

    async def reconnected() -> None:  # the broker's check after a reconnect, with a bug the first 3 times
        nonlocal checks
        checks += 1
        if checks <= 3:
            raise KeyError("a bug in the check")

    async def failing_check(node: link.SingleLink, tasks: list[asyncio.Task[None]]) -> tuple[float | None, list]:
        # the channel connection drops; the check after the reconnect fails 3 times, then passes
        assert redis_server.command("CLIENT", "KILL", "TYPE", "pubsub").startswith(":")
        await until(lambda: not node.healthy, 2.0)
        return await until(lambda: node.healthy, 5.0), ended(tasks)

    back_after, died = asyncio.run(with_link(url, failing_check, reconnected))
    assert not died, died  # before the fix the reader ended with the KeyError: never ready again
    assert back_after is not None and back_after < READY_WITHIN_S, back_after
    assert checks == 4, checks
    errors = broker_lines(caplog, logging.ERROR)
    # told once, with its traceback (rate-bounded: not once per failed attempt)
    assert len(errors) == 1 and "a reconnect failed unexpectedly (KeyError" in errors[0], errors
    assert all(r.exc_info for r in caplog.records if r.levelno >= logging.ERROR), errors


def test_a_flapping_redis_gets_a_bounded_number_of_state_lines(redis_server, monkeypatch, caplog):
    url = fast_link(monkeypatch, redis_server)
    monkeypatch.setattr(link, "STATE_LINE_EVERY_S", 1.0, raising=False)  # (no such knob before)
    caplog.set_level("WARNING", logger="gateway.broker")

    async def flapping(node: link.SingleLink, tasks: list[asyncio.Task[None]]) -> tuple[int, float | None]:
        flaps = 0
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # refused 50 ms, served 50 ms: a change every attempt or so
            refuse(redis_server, True)
            await until(lambda: not node.healthy, 1.0)
            await asyncio.sleep(0.05)
            refuse(redis_server, False)
            await until(lambda: node.healthy, 1.0)
            flaps += 1
            await asyncio.sleep(0.05)
        ready = await until(lambda: node.healthy, 2.0)
        await asyncio.sleep(1.2)  # the deferred line
        return flaps, ready

    flaps, ready = asyncio.run(with_link(url, flapping))
    assert ready is not None
    lines = broker_lines(caplog)
    assert flaps >= 8, flaps
    # 2 at once, then one a second over the ~2.5 s: never one per change (2 x flaps)
    assert len(lines) <= 2 + 4, lines
    assert any("more changes since the last line" in m for m in lines), lines  # what a line stands for
    assert BACK.search(lines[-1]), lines  # the last line tells the state: ready


def readyz_workers(url: str) -> dict[int, int]:
    """The status each worker answered /readyz with (new connections: SO_REUSEPORT picks the worker)."""
    seen: dict[int, int] = {}
    for _ in range(40):
        with httpx.Client(timeout=5) as http:
            reply = http.get(f"{url}/readyz")
        seen[reply.json()["worker"]] = reply.status_code
        if len(seen) == 2:
            break
    return seen


def test_two_workers_each_log_one_line_down_and_one_back_with_the_downtime(nodes, redis_server):
    down_s = 6.0
    node = nodes.start("a", server={"workers": 2})
    assert readyz_workers(node.http_url) == {0: 200, 1: 200}
    redis_server.stop()
    time.sleep(down_s)  # 2 attempts a second per worker, each refused: a dozen failed reconnects each
    assert set(readyz_workers(node.http_url).values()) == {503}
    redis_server.start()
    served = time.monotonic()
    ready: dict[int, float] = {}
    while time.monotonic() - served < 10 and len(ready) < 2:
        for worker, status in readyz_workers(node.http_url).items():
            if status == 200:
                ready.setdefault(worker, time.monotonic() - served)
        time.sleep(0.05)
    assert set(ready) == {0, 1}, ready
    # the pause before the next attempt (0.5 s) plus one attempt, and the sampling of the workers
    assert max(ready.values()) < 2.0, ready
    time.sleep(0.5)
    log = node.log()
    for worker in (0, 1):
        lines = [line for line in log.splitlines() if f"worker {worker} gateway.broker:" in line]
        down = [line for line in lines if DOWN.search(line)]
        back = [m for m in map(BACK.search, lines) if m is not None]
        assert len(down) == 1 and len(back) == 1 and len(lines) == 2, lines  # and none per attempt
        assert down_s - 0.5 < float(back[0].group(1)) < down_s + 3.0, lines
        assert int(back[0].group(2)) >= 8, lines
    print(f"\nready {max(ready.values()):.2f} s after Redis was back; {back[0].group(0).strip()}")
