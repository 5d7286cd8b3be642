"""The fan-out writer's two `Sender`s (the compiled gateway/_fanwrite.c and its twin gateway/fanwrite_py.py)
against a hostile descriptor list: `submit` reads each descriptor through `__index__`, which runs Python code
that may change the list under it. The call must raise or work, never crash the process. Each hostile call
runs in a child interpreter, so a crash fails the test instead of killing pytest."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from importlib.util import find_spec

import pytest

#: the module of each implementation, by test id; the compiled one skips only where it is not built
MODULES = {"c": "gateway._fanwrite", "python": "gateway.fanwrite_py"}


@pytest.fixture(params=sorted(MODULES))
def module(request: pytest.FixtureRequest) -> str:
    if find_spec(MODULES[request.param]) is None:
        pytest.skip("the fan-out writer is not built")
    return MODULES[request.param]


#: the child's preamble: a socket pair and a Sender; `Shrinker` empties (or grows) the list when read
PREAMBLE = textwrap.dedent("""
    import importlib
    import socket
    import sys

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

    sender = importlib.import_module(sys.argv[1]).Sender()
""")


def run_child(module: str, body: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", PREAMBLE + textwrap.dedent(body), module], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize("count", [3, 200])  # a small job (sent by `wait`) and a crowd's (the sender's thread)
def test_a_list_emptied_while_its_descriptors_are_read_neither_crashes_nor_sends_freed_items(module: str, count: int) -> None:
    child = run_child(
        module,
        f"""
        fds.extend([Shrinker()] + [ours.fileno()] * {count - 1})
        try:
            sender.submit(fds, b"frame")
        except (TypeError, ValueError) as error:
            print("raised", type(error).__name__)
        else:
            print("shortfalls", sender.wait())
        print("list now", len(fds))
    """,
    )
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr[-2000:]}"
    assert "list now 0" in child.stdout


def test_a_list_grown_while_its_descriptors_are_read_sends_to_the_descriptors_it_held_at_the_call(module: str) -> None:
    child = run_child(
        module,
        """
        fds.extend([Grower(), ours.fileno()])
        sender.submit(fds, b"frame")
        print("shortfalls", sender.wait())
        print("received", peer.recv(1 << 16))
    """,
    )
    assert child.returncode == 0, f"the child died ({child.returncode}): {child.stderr[-2000:]}"
    assert "shortfalls []" in child.stdout
    assert "received b'frameframe'" in child.stdout
