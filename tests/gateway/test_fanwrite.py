"""The compiled fan-out writer's sender (gateway/_fanwrite.c): frames queued for many sockets are sent on
its own thread; `wait` reports what a socket did not take, indexed in the order of submission."""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator

import pytest

from gateway import fanwrite

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(fanwrite.Sender is None, reason="the fan-out writer is not built")]


@pytest.fixture
def pairs() -> Iterator[list[tuple[socket.socket, socket.socket]]]:
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


def test_every_socket_gets_its_jobs_frame_and_shortfalls_are_indexed_across_jobs(pairs) -> None:
    assert fanwrite.Sender is not None
    sender = fanwrite.Sender()
    fill(pairs[4][0])  # the second socket of the second job
    closed = os.dup(pairs[5][0].fileno())
    os.close(closed)  # a descriptor no longer open: send fails with EBADF
    sender.submit([ours.fileno() for ours, _ in pairs[:3]] * 50, b"first")  # a crowd's slice: on the thread
    sender.submit([pairs[3][0].fileno(), pairs[4][0].fileno(), closed], b"second")  # small: sent by `wait`
    sender.submit([pairs[6][0].fileno()], b"third")
    assert sender.wait() == [(151, -errno.EAGAIN), (152, -errno.EBADF)]
    assert [peer.recv(1024) for _, peer in pairs[:3]] == [b"first" * 50] * 3
    assert pairs[3][1].recv(64) == b"second"
    assert pairs[6][1].recv(64) == b"third"
    # the next wait counts from 0 again, and reports nothing when every socket took its frame
    sender.submit([pairs[6][0].fileno()], b"again")
    assert sender.wait() == []
    assert pairs[6][1].recv(64) == b"again"


def test_a_socket_that_takes_part_reports_the_bytes_it_took(pairs) -> None:
    assert fanwrite.Sender is not None
    sender = fanwrite.Sender()
    ours, peer = pairs[0]
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    big = b"y" * (1 << 20)  # more than a 4 KiB send buffer takes
    sender.submit([pairs[1][0].fileno(), ours.fileno(), pairs[2][0].fileno()], b"small")
    sender.submit([ours.fileno()], big)
    (index, taken), = sender.wait()
    assert index == 3 and 0 < taken < len(big)
    assert peer.recv(5) == b"small" and pairs[2][1].recv(64) == b"small"


def test_wait_without_submit_and_an_empty_job_report_nothing() -> None:
    assert fanwrite.Sender is not None
    sender = fanwrite.Sender()
    assert sender.wait() == []
    sender.submit([], b"nobody")
    assert sender.wait() == []
    with pytest.raises(ValueError):
        sender.submit([-1], b"bad descriptor")
    with pytest.raises(TypeError):
        sender.submit((1, 2), b"not a list")
    assert sender.wait() == []


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def test_a_small_job_is_sent_by_wait_and_a_crowd_by_the_senders_own_thread(pairs) -> None:
    assert fanwrite.Sender is not None
    sender = fanwrite.Sender()
    before = threads()
    sender.submit([pairs[0][0].fileno()] * 3, b"s")  # a small job alone: no thread is woken for it
    assert sender.wait() == [] and threads() == before
    assert pairs[0][1].recv(64) == b"sss"
    sender.submit([pairs[1][0].fileno()] * 200, b"c")  # a crowd's slice: the sender's thread starts
    assert sender.wait() == [] and threads() == before + 1
    assert pairs[1][1].recv(1024) == b"c" * 200
    sender.submit([pairs[2][0].fileno()], b"1")  # small jobs, even several, are sent by `wait`
    sender.submit([pairs[2][0].fileno()], b"2")
    assert sender.wait() == []
    assert pairs[2][1].recv(64) == b"12"
    del sender
    assert threads() == before  # the thread ends with its sender


def test_a_forked_child_sends_through_a_sender_its_parent_had_started(pairs) -> None:
    assert fanwrite.Sender is not None
    sender = fanwrite.Sender()
    sender.submit([pairs[0][0].fileno()] * 200, b"p")  # the parent's thread starts
    assert sender.wait() == []
    child = os.fork()
    if child == 0:  # the parent's thread did not come along: the child starts its own
        sender.submit([pairs[1][0].fileno()] * 200, b"c")
        os._exit(0 if sender.wait() == [] else 1)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert pairs[0][1].recv(1024) == b"p" * 200 and pairs[1][1].recv(1024) == b"c" * 200
