"""A Redis Sentinel topology on loopback for the chaos run and the cluster tests: a primary, a replica and
three sentinels (quorum 2) watching it with `down-after-milliseconds` 1000, each on a free port.

`lag_replica` makes the replica stop receiving the primary's writes (it replicates from a port nobody listens
on; the sentinels leave it so for `failover-timeout`), so a failover promotes a replica that lacks accepted
writes: the case the gateway must detect and announce."""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from .redisproc import REDIS_SERVER, RedisProcess, free_port, redis_binary

MASTER = "mymaster"
#: the sentinels' detection delay (their `down-after-milliseconds`)
DOWN_AFTER_MS = 1000
#: how long the sentinels leave a replica that replicates from elsewhere before they point it back (so
#: `lag_replica` holds for the length of a test or a chaos fault)
FAILOVER_TIMEOUT_MS = 30000


class SentinelProcess(RedisProcess):
    """One sentinel (`redis-server FILE --sentinel`), monitoring `MASTER` at the primary's port."""

    def __init__(self, workdir: Path, primary_port: int) -> None:
        super().__init__(workdir)
        self.primary_port = primary_port

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        conf = self.dir / "sentinel.conf"  # the sentinel rewrites it: written once, kept across restarts
        if not conf.exists():
            conf.write_text(
                f"port {self.port}\nbind 127.0.0.1\ndir {self.dir}\n"
                f"sentinel monitor {MASTER} 127.0.0.1 {self.primary_port} 2\n"
                f"sentinel down-after-milliseconds {MASTER} {DOWN_AFTER_MS}\n"
                f"sentinel failover-timeout {MASTER} {FAILOVER_TIMEOUT_MS}\n"
                f"sentinel parallel-syncs {MASTER} 1\n"
            )
        self.proc = subprocess.Popen(
            [redis_binary() or REDIS_SERVER, str(conf), "--sentinel"],
            stdout=open(self.dir / "sentinel.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        self.wait_for_pong("redis-server --sentinel")

    def primary(self) -> int | None:
        """The port of the primary this sentinel names now (None: it names none it can reach)."""
        reply = self.reply("SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER)
        parts = reply.split("\r\n")
        return int(parts[4]) if reply.startswith("*2") and len(parts) > 4 else None

    def knows(self) -> tuple[int, int]:
        """(replicas, other sentinels) this sentinel knows of."""
        replicas = self.reply("SENTINEL", "REPLICAS", MASTER).split("\r\n")[0]
        sentinels = self.reply("SENTINEL", "SENTINELS", MASTER).split("\r\n")[0]
        return int(replicas.lstrip("*")), int(sentinels.lstrip("*"))


#: (flags, master-link-status) of a replica a failover may promote
READY = {("slave", "ok")}


def _replica_fields(reply: str, port: int) -> tuple[str, str] | None:
    """(flags, master-link-status) of the replica on `port` in a `SENTINEL REPLICAS` reply (RESP2 text: each
    replica a flat array of field, value), None when it is not listed (or the reply came cut)."""
    values = [line for line in reply.split("\r\n") if line and line[0] not in "*$"]
    entries: list[list[str]] = []
    for value in values:
        if value == "name" and (not entries or len(entries[-1]) % 2 == 0):
            entries.append([])
        if entries:
            entries[-1].append(value)
    for entry in entries:
        fields = dict(zip(entry[::2], entry[1::2]))
        if fields.get("port") == str(port):
            return fields.get("flags", ""), fields.get("master-link-status", "")
    return None


class SentinelTopology:
    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.primary = RedisProcess(workdir / "primary")
        self.replica = RedisProcess(workdir / "replica", extra=("--replicaof", "127.0.0.1", str(self.primary.port)))
        self.sentinels = [SentinelProcess(workdir / f"sentinel{i}", self.primary.port) for i in range(3)]

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{s.port}" for s in self.sentinels]

    def broker_section(self) -> dict[str, object]:
        """The gateway's `[broker]` keys for this topology."""
        return {"url": "", "sentinel_addresses": self.addresses, "sentinel_master": MASTER}

    def start(self, timeout: float = 20.0) -> None:
        """Start everything; return once every sentinel knows the replica and the two other sentinels (a
        failover needs their votes)."""
        self.primary.start()
        self.replica.start()
        for sentinel in self.sentinels:
            sentinel.start()
        deadline = time.monotonic() + timeout
        while not all(s.knows() == (1, 2) for s in self.sentinels):
            if time.monotonic() > deadline:
                raise RuntimeError(f"sentinels did not find each other: {[s.knows() for s in self.sentinels]}")
            time.sleep(0.1)
        self.wait_replicated()

    def wait_replicated(self, timeout: float = 10.0) -> None:
        """The replica has every write the primary acknowledged so far (WAIT, a second at a time: the
        replies are read with a 2 s timeout)."""
        deadline = time.monotonic() + timeout
        while self.primary.command("WAIT", "1", "1000") != ":1":
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not catch up")

    def lag_replica(self) -> None:
        """From now on the replica receives none of the primary's writes (it keeps what it has)."""
        self.wait_replicated()
        if self.replica.command("REPLICAOF", "127.0.0.1", str(free_port())) != "+OK":
            raise RuntimeError("REPLICAOF refused")

    def kill_primary(self) -> RedisProcess:
        """kill -9 the process the sentinels name primary now; returns it."""
        port = self.sentinels[0].primary()
        victim = self.primary if port == self.primary.port else self.replica
        if victim.proc is not None:
            victim.proc.send_signal(signal.SIGKILL)
            victim.proc.wait(5)
            victim.proc = None
        return victim

    def replica_ready(self, port: int) -> bool:
        """Every sentinel lists the process on `port` as a replica it can reach, linked to its primary: a
        failover may pick it (one it still flags down, or whose link is not up, it will not promote)."""
        try:
            return all(_replica_fields(s.reply("SENTINEL", "REPLICAS", MASTER), port) in READY for s in self.sentinels)
        except OSError:
            return False

    def promoted(self, port: int) -> bool:
        """Every sentinel names the process on `port` primary."""
        try:
            return all(s.primary() == port for s in self.sentinels)
        except OSError:
            return False

    def stop(self) -> None:
        for process in (*self.sentinels, self.primary, self.replica):
            process.stop()
