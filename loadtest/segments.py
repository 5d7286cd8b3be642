"""TCP data segments a server sent from one port, read from the kernel's socket table (`ss`, iproute2).

On loopback the process whose call sends a segment pays for both ends of it (the send, the receive path in
softirq, the reader's wake-up), so segments per delivery explain much of a server's CPU per delivery: a
server that puts several messages in a segment pays that cost once. A segment Nagle's algorithm held back
leaves when an ACK arrives, and on loopback that is in the reader's call: charged to the load, not to the
server (docs/benchmarks.md, "Where a delivery's CPU goes").
"""

from __future__ import annotations

import re
import shutil
import subprocess

_PEER_AND_SEGS = re.compile(r"^\S+\s+\S+\s+\S+\s+(\S+)\s*\n[^\n]*?\bdata_segs_out:(\d+)", re.MULTILINE)


def parse(table: str) -> dict[str, int]:
    """``data_segs_out`` of each socket in the output of ``ss -tinH``, by peer address."""
    return {peer: int(segs) for peer, segs in _PEER_AND_SEGS.findall(table)}


def read(port: int) -> dict[str, int] | None:
    """Data segments sent so far by each established socket whose local port is ``port``, by peer
    address; None when `ss` is not installed or fails."""
    ss = shutil.which("ss")
    if ss is None:
        return None
    try:
        done = subprocess.run(
            [ss, "-tinH", "state", "established", f"( sport = :{port} )"], capture_output=True, text=True, timeout=10, check=True
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return parse(done.stdout)


def sent_between(before: dict[str, int] | None, after: dict[str, int] | None) -> int | None:
    """Segments sent between two reads: per socket open at the second, what it sent since the first (all
    it sent if it opened since). Sockets closed before the second read are not counted."""
    if before is None or after is None:
        return None
    return sum(segs - before.get(peer, 0) for peer, segs in after.items())
