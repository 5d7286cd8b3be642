"""The fan-out writer's `Sender`, both implementations (gateway/fanwrite.py): the compiled one
(gateway/_fanwrite.c) and its Python twin (gateway/fanwrite_py.py). Frames submitted for many sockets are
sent, one `send` per descriptor; `wait` reports what a socket did not take, indexed in the order of
submission. Only the compiled one sends on a thread of its own."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from gateway import fanwrite, fanwrite_py

pytestmark = pytest.mark.unit

Pairs = list[tuple[socket.socket, socket.socket]]


def compiled_sender() -> Any:
    try:
        from gateway import _fanwrite
    except ImportError:
        pytest.skip("the fan-out writer is not built (tests/gateway/test_fanwrite_build.py says where it must be)")
    return _fanwrite.Sender


@pytest.fixture(params=["c", "python"])
def sender_class(request: pytest.FixtureRequest) -> Any:
    """The class under test: the C one skips only where it is not built; the twin always runs."""
    return compiled_sender() if request.param == "c" else fanwrite_py.Sender


@pytest.fixture
def pairs() -> Iterator[Pairs]:
    made = [socket.socketpair() for _ in range(7)]
    for ours, _ in made:
        ours.setblocking(False)
    yield made
    for ours, peer in made:
        ours.close()
        peer.close()


def fill(sock: socket.socket) -> None:
    """Fill the socket's send buffer (its peer reads nothing)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    with contextlib.suppress(BlockingIOError):
        while True:
            sock.send(b"x" * 4096)


def test_every_socket_gets_its_jobs_frame_and_shortfalls_are_indexed_across_jobs(sender_class: Any, pairs: Pairs) -> None:
    sender = sender_class()
    fill(pairs[4][0])  # the second socket of the second job
    closed = os.dup(pairs[5][0].fileno())
    os.close(closed)  # a descriptor no longer open: send fails with EBADF
    sender.submit([ours.fileno() for ours, _ in pairs[:3]] * 50, b"first")  # a crowd's slice
    sender.submit([pairs[3][0].fileno(), pairs[4][0].fileno(), closed], b"second")
    sender.submit([pairs[6][0].fileno()], b"third")
    assert sender.wait() == [(151, -errno.EAGAIN), (152, -errno.EBADF)]
    assert [peer.recv(1024) for _, peer in pairs[:3]] == [b"first" * 50] * 3
    assert pairs[3][1].recv(64) == b"second"
    assert pairs[6][1].recv(64) == b"third"
    # the next wait counts from 0 again, and reports nothing when every socket took its frame
    sender.submit([pairs[6][0].fileno()], b"again")
    assert sender.wait() == []
    assert pairs[6][1].recv(64) == b"again"


def test_a_socket_that_takes_part_reports_the_bytes_it_took(sender_class: Any, pairs: Pairs) -> None:
    sender = sender_class()
    ours, peer = pairs[0]
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = b"y" * (1 << 20)  # more than a 4 KiB send buffer takes
    sender.submit([pairs[1][0].fileno(), ours.fileno(), pairs[2][0].fileno()], b"small")
    sender.submit([ours.fileno()], big)
    ((index, taken),) = sender.wait()
    assert index == 3 and 0 < taken < len(big)
    assert peer.recv(5) == b"small" and pairs[2][1].recv(64) == b"small"


def test_a_blocking_socket_is_not_waited_for_and_a_descriptor_that_is_no_socket_fails(sender_class: Any, pairs: Pairs) -> None:
    sender = sender_class()
    ours, _ = pairs[0]
    fill(ours)
    ours.setblocking(True)  # MSG_DONTWAIT: the send does not block all the same
    read_end, write_end = os.pipe()
    try:
        sender.submit([ours.fileno(), write_end], b"frame")
        assert sender.wait() == [(0, -errno.EAGAIN), (1, -errno.ENOTSOCK)]
        os.set_blocking(read_end, False)
        with pytest.raises(BlockingIOError):  # nothing was written to the pipe
            os.read(read_end, 64)
    finally:
        os.close(read_end)
        os.close(write_end)


def test_a_socket_whose_peer_left_reports_epipe_and_raises_no_signal(sender_class: Any, pairs: Pairs) -> None:
    sender = sender_class()
    ours, peer = pairs[0]
    peer.close()
    sender.submit([ours.fileno()], b"frame")  # MSG_NOSIGNAL: EPIPE, not SIGPIPE, whatever the handler
    assert sender.wait() == [(0, -errno.EPIPE)]


def test_wait_without_submit_and_an_empty_job_report_nothing(sender_class: Any) -> None:
    sender = sender_class()
    assert sender.wait() == []
    sender.submit([], b"nobody")
    assert sender.wait() == []
    with pytest.raises(ValueError):
        sender.submit([-1], b"bad descriptor")
    with pytest.raises(ValueError):
        sender.submit([1 << 31], b"too big for an int")
    with pytest.raises(OverflowError):
        sender.submit([1 << 64], b"too big for a long")
    with pytest.raises(TypeError):
        sender.submit([1, "2"], b"not a descriptor")
    with pytest.raises(TypeError):
        sender.submit((1, 2), b"not a list")
    with pytest.raises(TypeError):
        sender.submit([1], "not bytes")
    with pytest.raises(TypeError):
        sender.submit([1])
    with pytest.raises(TypeError):
        sender_class(1)
    assert sender.wait() == []


def test_a_refused_submit_sends_nothing_not_even_to_the_good_descriptors_before_the_bad_one(
    sender_class: Any, pairs: Pairs
) -> None:
    sender = sender_class()
    ours, peer = pairs[0]
    with pytest.raises(ValueError):
        sender.submit([ours.fileno(), -5, ours.fileno()], b"never")
    sender.submit([ours.fileno()], b"after")
    assert sender.wait() == []  # and the refused job counted no index
    assert peer.recv(64) == b"after"


def test_any_bytes_like_frame_is_sent(sender_class: Any, pairs: Pairs) -> None:
    sender = sender_class()
    ours, peer = pairs[0]
    sender.submit([ours.fileno()], bytearray(b"ab"))
    sender.submit([ours.fileno()], memoryview(b"cd"))
    assert sender.wait() == []
    assert peer.recv(64) == b"abcd"


def thread_ids() -> set[str]:
    """This process's threads: the ones a test starts are told apart from those other code of the worker
    process may start or end meanwhile."""
    return set(os.listdir("/proc/self/task"))


def test_the_compiled_sender_sends_a_small_job_in_wait_and_a_crowd_on_its_own_thread(pairs: Pairs) -> None:
    sender = compiled_sender()()
    before = thread_ids()
    sender.submit([pairs[0][0].fileno()] * 3, b"s")  # a small job alone: no thread is woken for it
    assert sender.wait() == []
    small = thread_ids() - before
    assert pairs[0][1].recv(64) == b"sss"
    sender.submit([pairs[1][0].fileno()] * 200, b"c")  # a crowd's slice: the sender's thread starts
    assert sender.wait() == []
    started = thread_ids() - before - small
    assert len(started) == 1 and not small
    assert pairs[1][1].recv(1024) == b"c" * 200
    sender.submit([pairs[2][0].fileno()], b"1")  # small jobs, even several, are sent by `wait`
    sender.submit([pairs[2][0].fileno()], b"2")
    assert sender.wait() == []
    assert pairs[2][1].recv(64) == b"12"
    del sender
    assert not started & thread_ids()  # the thread ends with its sender (joined as it is freed)


def test_the_python_twin_starts_no_thread(pairs: Pairs) -> None:
    before = thread_ids()
    sender = fanwrite_py.Sender()
    sender.submit([pairs[1][0].fileno()] * 200, b"c")
    assert sender.wait() == [] and not thread_ids() - before
    assert pairs[1][1].recv(1024) == b"c" * 200


def test_a_forked_child_sends_through_a_sender_its_parent_had_started(sender_class: Any, pairs: Pairs) -> None:
    sender = sender_class()
    sender.submit([pairs[0][0].fileno()] * 200, b"p")  # the parent's thread starts (the compiled one)
    assert sender.wait() == []
    child = os.fork()
    if child == 0:  # the parent's thread did not come along: the child starts its own
        sender.submit([pairs[1][0].fileno()] * 200, b"c")
        os._exit(0 if sender.wait() == [] else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pairs[0][1].recv(1024) == b"p" * 200 and pairs[1][1].recv(1024) == b"c" * 200


def test_raw_fd_gives_a_plain_sockets_descriptor_and_never_one_under_tls(pairs: Pairs) -> None:
    ours, _ = pairs[0]
    Transport = asyncio.BaseTransport  # holds the extra info `raw_fd` reads
    assert fanwrite.raw_fd(Transport({"socket": ours})) == ours.fileno()
    assert fanwrite.raw_fd(Transport({"socket": ours, "sslcontext": object()})) == -1
    assert fanwrite.raw_fd(Transport({"socket": ours, "ssl_object": object()})) == -1
    assert fanwrite.raw_fd(Transport({})) == -1


def test_a_socket_whose_transport_is_closing_or_holds_bytes_is_passed_over_as_taking_nothing(sender_class: Any) -> None:
    """With the sockets' transports, a crowd's frame never overtakes bytes a transport still holds, and
    never goes to a descriptor whose transport is closing (its number may already be another socket's)."""

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        made = [socket.socketpair() for _ in range(3)]
        transports = []
        for ours, _ in made:
            transport, _ = await loop.create_connection(asyncio.Protocol, sock=ours)
            transports.append(transport)
        fds = [ours.fileno() for ours, _ in made]
        busy, closing = transports[1], transports[2]
        fill(made[1][0])
        busy.write(b"held")  # the kernel takes no more: the transport holds it
        assert busy.get_write_buffer_size() > 0
        closing.close()
        sender = sender_class()
        sender.submit(fds, b"frame", transports)
        assert sender.wait() == [(1, 0), (2, 0)]
        assert made[0][1].recv(64) == b"frame"
        with pytest.raises(ValueError):
            sender.submit(fds, b"frame", transports[:2])
        with pytest.raises(TypeError):
            sender.submit(fds, b"frame", tuple(transports))
        assert sender.wait() == []
        for transport in transports:
            transport.abort()
        for _, peer in made:
            peer.close()

    asyncio.run(scenario())
