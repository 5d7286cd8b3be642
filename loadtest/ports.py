"""Free loopback ports for the servers the tools and the tests start (gateways, redis-server, nginx).

A port the kernel hands out for `bind(0)` comes from its ephemeral range, which is also where every outgoing
connection takes its local port: between our check and the server's own bind, one of a load run's thousands
of client sockets can take it, and the server fails to start. So the port is chosen at random below that
range, where only servers bind, and checked free."""

from __future__ import annotations

import random
import socket
from pathlib import Path

#: the lowest port we choose (below: ports well-known services and their tools like to use)
LOWEST = 10_000
_EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
#: not the module-level generator: hypothesis and pytest seed it alike in every worker
_CHOICE = random.SystemRandom()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 where it cannot be read)."""
    try:
        return int(_EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1") -> int:
    """A port on `host` nothing is bound to now, below the ephemeral range (inside it if that range starts too
    low to leave room)."""
    top = _ephemeral_low()
    for _ in range(100):
        port = _CHOICE.randrange(LOWEST, top) if top - LOWEST >= 1000 else 0
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise RuntimeError(f"no free port on {host}")
