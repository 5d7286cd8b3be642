"""Synchronous tests of core.byte_ring (docs/design/byte-ring.md §3-§6, §8): no event loop, no sockets."""

from __future__ import annotations

import ast
import pathlib

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from core.byte_ring import (
    ByteRing,
    ByteRingConfig,
    FlowAction,
    ReceiverState,
    TooManyReceivers,
    UnknownReceiver,
)

pytestmark = pytest.mark.unit

MIB = 1024 * 1024
MS = 1_000_000  # ns


def small(**kw) -> ByteRingConfig:
    base = dict(
        capacity_bytes=1000,
        soft_lag_bytes=100,
        hard_lag_bytes=300,
        kick_grace_ms=50,
        pause_watermark_pct=80,
        resume_watermark_pct=55,
        recv_chunk_bytes=10,
        max_receivers=4,
    )
    base.update(kw)
    return ByteRingConfig(**base)


def read_all(ring: ByteRing, rid, now: int = 0) -> bytes:
    views = ring.readable(rid)
    out = b"".join(bytes(v) for v in views)
    ring.advance(rid, len(out), now)
    return out


# ----------------------------------------------------------------- sans-I/O


def test_core_module_does_no_io():
    src = pathlib.Path(__file__).resolve().parents[2] / "core" / "byte_ring.py"
    tree = ast.parse(src.read_text())
    forbidden = {
        "asyncio",
        "anyio",
        "socket",
        "select",
        "selectors",
        "time",
        "starlette",
        "uvicorn",
        "websockets",
        "gateway",
        "threading",
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        else:
            continue
        for name in names:
            assert name.split(".")[0] not in forbidden, name


# ------------------------------------------------------------------- config


def test_config_defaults_are_seed_003():
    cfg = ByteRingConfig()
    assert cfg.capacity_bytes == 256 * MIB
    assert cfg.soft_lag_bytes == 32 * MIB
    assert cfg.hard_lag_bytes == 96 * MIB
    assert cfg.kick_grace_ms == 500
    assert cfg.pause_watermark_pct == 80
    assert cfg.resume_watermark_pct == 55
    assert cfg.recv_chunk_bytes == 64 * 1024
    assert cfg.max_receivers == 16
    # 204.8 MiB > 96 MiB: a stalled receiver can pass hard_lag before the sender is paused.
    assert cfg.lag_bound_bytes > cfg.hard_lag_bytes


@pytest.mark.parametrize(
    "kw",
    [
        dict(resume_watermark_pct=80),  # resume == pause
        dict(resume_watermark_pct=90),
        dict(pause_watermark_pct=101),
        dict(resume_watermark_pct=0),
        dict(hard_lag_bytes=50),  # < soft
        dict(hard_lag_bytes=800),  # >= pause threshold: a stalled receiver would never be kicked
        dict(capacity_bytes=15),  # < 2 * recv_chunk
        dict(capacity_bytes=0),
        dict(recv_chunk_bytes=-1),
        dict(kick_grace_ms=-1),
        dict(max_receivers=0),
    ],
)
def test_config_rejects_inconsistent_limits(kw):
    with pytest.raises(ValueError):
        small(**kw)


def test_config_lag_bound_uses_free_chunk_rule():
    # pause at 100% never triggers before "free < recv_chunk": the bound is capacity - chunk + 1.
    cfg = small(pause_watermark_pct=100, hard_lag_bytes=900)
    assert cfg.lag_bound_bytes == 991
    with pytest.raises(ValueError):
        small(pause_watermark_pct=100, hard_lag_bytes=991)


# ------------------------------------------------------------ data movement


def test_receiver_gets_only_bytes_written_after_it_joined():
    ring = ByteRing(small())
    ring.add_receiver("a", 0)
    assert ring.write(b"hello") == 5
    assert ring.add_receiver("b", 0) == 5
    ring.write(b" world")
    assert read_all(ring, "a") == b"hello world"
    assert read_all(ring, "b") == b" world"
    assert ring.readable("a") == []


def test_readable_is_zero_copy_and_splits_at_the_wrap():
    ring = ByteRing(small(capacity_bytes=100, soft_lag_bytes=20, hard_lag_bytes=40))
    ring.add_receiver("a", 0)
    ring.write(bytes(range(90)))
    assert len(read_all(ring, "a")) == 90
    ring.write(bytes(range(100, 120)))  # positions 90..109 -> offsets 90..99 and 0..9
    views = ring.readable("a")
    assert [len(v) for v in views] == [10, 10]
    assert all(isinstance(v, memoryview) and v.obj is ring._buf for v in views)
    assert b"".join(views) == bytes(range(100, 120))
    ring.advance("a", 20, 0)
    assert ring.readable("a") == []


def test_write_never_overwrites_unread_bytes():
    ring = ByteRing(small(capacity_bytes=100, soft_lag_bytes=20, hard_lag_bytes=40))
    ring.add_receiver("slow", 0)
    ring.add_receiver("fast", 0)
    assert ring.write(b"a" * 70) == 70
    read_all(ring, "fast")
    assert ring.free_bytes == 30
    assert ring.write(b"b" * 50) == 30  # bounded by the slowest receiver
    assert ring.free_bytes == 0
    assert ring.write(b"c") == 0
    assert read_all(ring, "slow") == b"a" * 70 + b"b" * 30
    assert ring.free_bytes == 70  # "fast" has not read the last 30 yet
    assert read_all(ring, "fast") == b"b" * 30
    assert ring.free_bytes == 100


def test_reserve_commit_is_the_zero_copy_write():
    ring = ByteRing(small(capacity_bytes=100, soft_lag_bytes=20, hard_lag_bytes=40, recv_chunk_bytes=16))
    ring.add_receiver("a", 0)
    view = ring.reserve()
    assert len(view) == 16 and view.obj is ring._buf
    view[:5] = b"abcde"
    assert ring.commit(5) == 5
    assert read_all(ring, "a") == b"abcde"
    with pytest.raises(ValueError):
        ring.commit(1)  # nothing reserved any more
    ring.write(b"x" * 90)  # write_pos 95: only 5 contiguous bytes before the wrap
    assert len(ring.reserve()) == 5
    read_all(ring, "a")
    ring.write(b"y" * 5)
    assert len(ring.reserve()) == 16  # wrapped to offset 0


def test_reserve_never_lends_unread_memory():
    ring = ByteRing(small(capacity_bytes=100, soft_lag_bytes=20, hard_lag_bytes=40, recv_chunk_bytes=16))
    ring.add_receiver("a", 0)
    ring.write(b"z" * 92)
    assert len(ring.reserve()) == 8
    ring.write(b"z" * 8)
    with pytest.raises(BufferError):
        ring.reserve()


def test_drain_mode_drops_and_counts():
    ring = ByteRing(small())
    assert ring.drain_mode
    assert ring.write(b"x" * 700) == 700
    view = ring.reserve()
    assert len(view) == 10
    assert ring.commit(7) == 0
    m = ring.metrics()
    assert m.bytes_dropped_no_receiver == 707
    assert m.bytes_received == 707
    assert ring.write_pos == 0  # dropped bytes take no position
    assert ring.used_bytes == 0
    ring.add_receiver("a", 0)
    ring.write(b"new")
    assert read_all(ring, "a") == b"new"
    ring.remove_receiver("a")
    ring.write(b"gone")
    assert ring.metrics().bytes_dropped_no_receiver == 711
    assert ring.metrics().bytes_received == 714


def test_receiver_bookkeeping_errors():
    ring = ByteRing(small(max_receivers=2))
    ring.add_receiver(1, 0)
    ring.add_receiver(2, 0)
    with pytest.raises(TooManyReceivers):
        ring.add_receiver(3, 0)
    with pytest.raises(ValueError):
        ring.add_receiver(1, 0)
    ring.remove_receiver(2)
    with pytest.raises(UnknownReceiver):
        ring.remove_receiver(2)
    with pytest.raises(UnknownReceiver):
        ring.readable(2)
    ring.add_receiver(3, 0)
    assert sorted(ring.receiver_ids()) == [1, 3]
    assert ring.metrics().total_connections == 3
    ring.write(b"abc")
    with pytest.raises(ValueError):
        ring.advance(1, 4, 0)


def test_in_flight_bytes_stay_pinned_until_released():
    ring = ByteRing(small(capacity_bytes=100, soft_lag_bytes=20, hard_lag_bytes=40, recv_chunk_bytes=10))
    ring.add_receiver("a", 0)
    ring.write(b"q" * 60)
    views = ring.readable("a")
    ring.advance("a", 60, 1, in_flight=60)  # handed to a transport that keeps the memoryview
    assert ring.readable("a") == []  # nothing more to hand over
    assert ring.lag("a") == 60 and ring.used_bytes == 60
    assert ring.write(b"r" * 100) == 40  # only the 40 free bytes: the pinned 60 are untouched
    assert b"".join(views) == b"q" * 60
    assert ring.metrics().bytes_sent == 0
    ring.advance("a", 0, 5 * MS, in_flight=25)  # transport drained 35 bytes
    assert ring.lag("a") == 65
    assert ring.metrics().bytes_sent == 35
    with pytest.raises(ValueError):
        ring.advance("a", 0, 6 * MS, in_flight=30)  # released bytes cannot be pinned again
    info = ring.receiver_info("a", 6 * MS)
    assert (info.lag, info.in_flight, info.bytes_sent) == (65, 25, 35)


# ---------------------------------------------------------------- lag policy


def test_lag_states_and_thresholds():
    ring = ByteRing(small())  # soft 100, hard 300, grace 50 ms
    ring.add_receiver("r", 0)
    ring.write(b"x" * 100)
    assert ring.receiver_state("r", 0) is ReceiverState.HEALTHY  # lag == soft
    ring.write(b"x")
    assert ring.receiver_state("r", 0) is ReceiverState.SLOW
    ring.write(b"x" * 199)
    assert ring.lag("r") == 300
    assert ring.receiver_state("r", 10**12) is ReceiverState.SLOW  # lag == hard: never kicked
    assert ring.check_lagging(10**12) == []
    ring.write(b"x")
    assert ring.receiver_state("r", 10**12) is ReceiverState.LAGGING  # over hard, window not started


def test_kick_after_grace_without_progress():
    ring = ByteRing(small())
    ring.add_receiver("slow", 0)
    ring.add_receiver("ok", 0)
    ring.write(b"x" * 301)
    read_all(ring, "ok", 0)
    t0 = 1000 * MS
    assert ring.check_lagging(t0) == []  # over hard seen now: the grace window starts here
    assert ring.receiver_state("slow", t0 + 50 * MS) is ReceiverState.LAGGING
    assert ring.check_lagging(t0 + 50 * MS) == []  # exactly the grace: not yet (docs/design/byte-ring.md §4.2)
    assert ring.receiver_state("slow", t0 + 50 * MS + 1) is ReceiverState.KICK
    assert ring.check_lagging(t0 + 50 * MS + 1) == ["slow"]
    assert "slow" not in ring
    assert ring.receiver_ids() == ["ok"]
    assert ring.metrics().disconnections_lag == 1


def test_progress_restarts_the_grace_window():
    ring = ByteRing(small())
    ring.add_receiver("r", 0)
    ring.write(b"x" * 350)
    assert ring.check_lagging(0) == []
    ring.advance("r", 10, 40 * MS)  # still lag 340 > hard, but it progressed
    assert ring.check_lagging(80 * MS) == []
    assert ring.receiver_state("r", 90 * MS) is ReceiverState.LAGGING
    assert ring.check_lagging(90 * MS + 1) == ["r"]


def test_back_under_hard_clears_the_window():
    ring = ByteRing(small())
    ring.add_receiver("r", 0)
    ring.write(b"x" * 350)
    ring.check_lagging(0)
    ring.advance("r", 100, 10 * MS)  # lag 250 <= hard
    assert ring.check_lagging(20 * MS) == []
    ring.write(b"x" * 100)  # over hard again at 200 ms; last progress was at 10 ms
    assert ring.check_lagging(200 * MS) == []
    assert ring.check_lagging(250 * MS) == []
    assert ring.check_lagging(250 * MS + 1) == ["r"]


# ------------------------------------------------------------- flow control


def test_pause_and_resume_thresholds_exactly_per_seed():
    cfg = small()  # capacity 1000, chunk 10: pause at used >= 800, resume at used <= 550
    assert (cfg.pause_threshold_bytes, cfg.resume_threshold_bytes) == (800, 550)
    ring = ByteRing(cfg)
    ring.add_receiver("r", 0)
    ring.write(b"x" * 799)
    assert ring.update_flow(0) is None and not ring.sender_paused
    ring.write(b"x")
    assert ring.update_flow(1 * MS) is FlowAction.PAUSE and ring.sender_paused
    assert ring.update_flow(2 * MS) is None  # already paused
    ring.advance("r", 249, 3 * MS)  # used 551
    assert ring.update_flow(3 * MS) is None and ring.sender_paused
    ring.advance("r", 1, 4 * MS)  # used 550
    assert ring.update_flow(4 * MS) is FlowAction.RESUME and not ring.sender_paused
    assert ring.update_flow(5 * MS) is None
    # hysteresis: between the watermarks the state is kept both ways
    ring.write(b"x" * 249)  # used 799
    assert ring.update_flow(6 * MS) is None and not ring.sender_paused
    m = ring.metrics()
    assert m.sender_recv_pause_count == 1
    assert m.sender_recv_pause_ns == 3 * MS
    assert FlowAction.PAUSE == "pause" and FlowAction.RESUME == "resume"


def test_pause_on_free_below_chunk_and_resume_needs_two_chunks():
    # capacity 100, chunk 30: pause at used >= 80 or free < 30 (used > 70);
    # resume at used <= 55 and free >= 60 (used <= 40).
    cfg = small(capacity_bytes=100, recv_chunk_bytes=30, soft_lag_bytes=20, hard_lag_bytes=40)
    ring = ByteRing(cfg)
    ring.add_receiver("r", 0)
    ring.write(b"x" * 70)
    assert ring.update_flow(0) is None
    ring.write(b"x")
    assert ring.update_flow(0) is FlowAction.PAUSE
    ring.advance("r", 16, 0)  # used 55: under the resume watermark but free 45 < 60
    assert ring.update_flow(0) is None
    ring.advance("r", 15, 0)  # used 40, free 60
    assert ring.update_flow(0) is FlowAction.RESUME


def test_pause_time_counts_the_current_pause_and_last_receiver_leaving_resumes():
    ring = ByteRing(small())
    ring.add_receiver("r", 0)
    ring.write(b"x" * 900)
    assert ring.update_flow(10 * MS) is FlowAction.PAUSE
    assert ring.metrics(now_ns=25 * MS).sender_recv_pause_ns == 15 * MS
    assert ring.metrics().sender_recv_pause_ns == 0
    ring.remove_receiver("r")
    assert ring.used_bytes == 0
    assert ring.update_flow(30 * MS) is FlowAction.RESUME  # drain mode reads the sender again
    assert ring.metrics(now_ns=99 * MS).sender_recv_pause_ns == 20 * MS


def test_kicking_the_stalled_receiver_releases_a_paused_sender():
    ring = ByteRing(small())
    ring.add_receiver("stalled", 0)
    ring.add_receiver("ok", 0)
    t = 0
    while ring.update_flow(t) is not FlowAction.PAUSE:
        ring.write(b"x" * 10)
        read_all(ring, "ok", t)
        t += MS
    assert ring.lag("stalled") >= 800 > ring.config.hard_lag_bytes
    assert ring.check_lagging(t) == []  # the grace window starts now
    assert ring.check_lagging(t + 49 * MS) == []
    assert ring.check_lagging(t + 51 * MS) == ["stalled"]
    assert ring.update_flow(t + 60 * MS) is FlowAction.RESUME


def test_metrics_fields():
    ring = ByteRing(small())
    ring.add_receiver("a", 0)
    ring.add_receiver("b", 0)
    ring.write(b"x" * 120)
    ring.advance("a", 100, 0)
    m = ring.metrics().as_dict()
    assert m == {
        "bytes_received": 120,
        "bytes_sent": 100,
        "bytes_dropped_no_receiver": 0,
        "active_receivers": 2,
        "total_connections": 2,
        "disconnections_lag": 0,
        "ring_buffer_used": 120,
        "max_receiver_lag": 120,
        "sender_recv_pause_count": 0,
        "sender_recv_pause_ns": 0,
    }


# ------------------------------------------------------- stateful invariants


class RingMachine(RuleBasedStateMachine):
    """Drives a small ring the way the asyncio adapter does (reserve/commit or write, update_flow
    after each change, sends that may leave bytes in flight) against a plain model: every receiver
    gets exactly the stored bytes written after it joined, in order, and bytes still referenced by
    a simulated transport are never overwritten before they are released."""

    def __init__(self):
        super().__init__()
        self.cfg = ByteRingConfig(
            capacity_bytes=64,
            soft_lag_bytes=16,
            hard_lag_bytes=32,
            kick_grace_ms=5,
            pause_watermark_pct=75,
            resume_watermark_pct=40,
            recv_chunk_bytes=8,
            max_receivers=3,
        )
        self.ring = ByteRing(self.cfg)
        self.now = 0
        self.next_id = 0
        self.counter = 0
        self.stream = bytearray()  # every stored byte, by position
        self.expected: dict[int, int] = {}  # rid -> next position it must receive
        self.in_flight: dict[int, list[tuple[memoryview, bytes]]] = {}

    def _byte_chunk(self, n: int) -> bytes:
        out = bytes((self.counter + i) % 251 for i in range(n))
        self.counter += n
        return out

    def _flow(self):
        action = self.ring.update_flow(self.now)
        if action is not None:
            event(f"flow {action.value}")

    @rule()
    def add(self):
        rid = self.next_id
        self.next_id += 1
        if self.ring.receiver_count >= self.cfg.max_receivers:
            with pytest.raises(TooManyReceivers):
                self.ring.add_receiver(rid, self.now)
            return
        assert self.ring.add_receiver(rid, self.now) == len(self.stream)
        self.expected[rid] = len(self.stream)
        self.in_flight[rid] = []

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def remove(self, data):
        rid = data.draw(st.sampled_from(sorted(self.expected)))
        self.ring.remove_receiver(rid)
        del self.expected[rid], self.in_flight[rid]
        self._flow()

    @precondition(lambda self: not self.ring.sender_paused)
    @rule(n=st.integers(1, 8))
    def recv_zero_copy(self, n):
        view = self.ring.reserve()
        assert len(view) >= 1  # never empty while not paused (update_flow contract)
        n = min(n, len(view))
        chunk = self._byte_chunk(n)
        view[:n] = chunk
        stored = self.ring.commit(n)
        if self.expected:
            assert stored == n
            self.stream += chunk
        else:
            assert stored == 0
        self._flow()

    @rule(n=st.integers(0, 40))
    def write_copy(self, n):
        chunk = self._byte_chunk(n)
        free = self.ring.free_bytes
        accepted = self.ring.write(chunk)
        if self.expected:
            assert accepted == min(n, free)
            self.stream += chunk[:accepted]
        else:
            assert accepted == n
        self._flow()

    @precondition(lambda self: self.expected)
    @rule(data=st.data(), pin=st.booleans())
    def send(self, data, pin):
        rid = data.draw(st.sampled_from(sorted(self.expected)))
        views = self.ring.readable(rid)
        if len(views) == 2:
            event("readable wraps")
        pending = b"".join(bytes(v) for v in views)
        start = self.expected[rid]
        assert pending == bytes(self.stream[start:])
        n = data.draw(st.integers(0, len(pending)))
        in_flight = sum(len(v) for v, _ in self.in_flight[rid])
        # A transport's buffer is FIFO: once it holds bytes, everything handed after them waits too.
        if (pin or in_flight) and n:
            # Keep the views as uvloop's transport does; check them when released.
            take, left = [], n
            for v in views:
                part = v[: min(left, len(v))]
                if part:
                    take.append((part, bytes(part)))
                left -= len(part)
            self.in_flight[rid].extend(take)
            in_flight += n
        self.expected[rid] = start + n
        self.ring.advance(rid, n, self.now, in_flight=in_flight)
        self._flow()

    @precondition(lambda self: any(self.in_flight.values()))
    @rule(data=st.data())
    def drain_transport(self, data):
        rid = data.draw(st.sampled_from(sorted(r for r, f in self.in_flight.items() if f)))
        pinned = self.in_flight[rid]
        k = data.draw(st.integers(1, len(pinned)))
        for view, copy in pinned[:k]:
            assert bytes(view) == copy, "ring overwrote bytes a transport still referenced"
        del pinned[:k]
        self.ring.advance(rid, 0, self.now, in_flight=sum(len(v) for v, _ in pinned))
        self._flow()

    @rule(dt_ms=st.integers(0, 8))
    def tick(self, dt_ms):
        self.now += dt_ms * MS
        kicked = self.ring.check_lagging(self.now)
        if kicked:
            event("kick")
        for rid in kicked:
            assert rid not in self.ring
            del self.expected[rid], self.in_flight[rid]
        self._flow()

    @invariant()
    def bounds_hold(self):
        ring = self.ring
        assert 0 <= ring.used_bytes <= self.cfg.capacity_bytes
        assert ring.write_pos == len(self.stream)
        if not ring.sender_paused:
            assert ring.free_bytes >= self.cfg.recv_chunk_bytes
        assert sorted(ring.receiver_ids()) == sorted(self.expected)
        for rid in self.expected:
            lag = ring.lag(rid)
            assert lag == len(self.stream) - (self.expected[rid] - sum(len(v) for v, _ in self.in_flight[rid]))
            assert lag <= ring.used_bytes
        for pinned in self.in_flight.values():
            for view, copy in pinned:
                assert bytes(view) == copy


RingMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestRingMachine = RingMachine.TestCase
