"""The compiled fan-out writer (gateway/_fanwrite.c) against a hostile descriptor list: `submit` reads each
descriptor through `__index__`, which runs Python code that may change the list under it. The call must
raise or work, never crash the process. Each hostile call runs in a child interpreter, so a crash fails the
test instead of killing pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from gateway import fanwrite

pytestmark = pytest.mark.skipif(fanwrite.Sender is None, reason="the fan-out writer is not built")

#: the child's preamble: a socket pair and a Sender; `Shrinker` empties (or grows) the list when read
PREAMBLE = textwrap.dedent("""
    import socket
    from gateway import _fanwrite

    ours, peer = socket.socketpair()
    ours.setblocking(False)
    fds = []

    class Shrinker:
        def __index__(self):
            fds.clear()
            return ours.fileno()

    class Grower:
        def __index__(self):
            fds.extend([ours.fileno()] * 1000)
            return ours.fileno()

    sender = _fanwrite.Sender()
""")


def run_child(body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", PREAMBLE + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize("count", [3, 200])  # a small job (sent by `wait`) and a crowd's (the sender's thread)
def test_a_list_emptied_while_its_descriptors_are_read_neither_crashes_nor_sends_freed_items(count: int) -> None:
    child = run_child(f"""
        fds.extend([Shrinker()] + [ours.fileno()] * {count - 1})
        try:
            sender.submit(fds, b"frame")
        except (TypeError, ValueError) as error:
            print("raised", type(error).__name__)
        else:
            print("shortfalls", sender.wait())
        print("list now", len(fds))
    """)
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr[-2000:]}"
    assert "list now 0" in child.stdout


def test_a_list_grown_while_its_descriptors_are_read_sends_to_the_descriptors_it_held_at_the_call() -> None:
    child = run_child("""
        fds.extend([Grower(), ours.fileno()])
        sender.submit(fds, b"frame")
        print("shortfalls", sender.wait())
        print("received", peer.recv(1 << 16))
    """)
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr[-2000:]}"
    assert "shortfalls []" in child.stdout
    assert "received b'frameframe'" in child.stdout
