"""A Redis Cluster on loopback for the chaos run and the cluster tests: three primaries and three replicas
(`redis-cli --cluster create --cluster-replicas 1`), `cluster-node-timeout` 2000, each on a free port.

`kill_primary` kill -9s the primary of a slot (its replica is promoted once the others agree it failed);
`lag_replica` first cuts that replica off, so it is promoted without the writes accepted since;
`move_slot` moves one slot to another primary as `redis-cli --cluster reshard` does (IMPORTING, MIGRATING,
MIGRATE of its keys, then SETSLOT NODE on every primary)."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

from .redisproc import RedisProcess, free_port

#: how long a primary may not answer before the others count it failed (and its replica takes over)
NODE_TIMEOUT_MS = 2000
REDIS_CLI = "redis-cli"


def command(*args: str) -> bytes:
    """One command in the protocol's array form."""
    return ("*%d\r\n" % len(args) + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)).encode()


def key_slot(key: str) -> int:
    """Redis Cluster's slot of `key` (CRC16 of its hash tag, or of the whole key)."""
    start = key.find("{")
    if start >= 0:
        end = key.find("}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    crc = 0
    for byte in key.encode():
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc % 16384


class ClusterNodeProcess(RedisProcess):
    def __init__(self, workdir: Path) -> None:
        # the cluster bus on a free port of its own (by default port + 10000, maybe taken or past 65535)
        self.bus_port = free_port()
        super().__init__(workdir, extra=self._options())

    def _options(self) -> tuple[str, ...]:
        return (
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            "nodes.conf",
            "--cluster-node-timeout",
            str(NODE_TIMEOUT_MS),
            "--cluster-port",
            str(self.bus_port),
            # a replica in sync at once (not after diskless sync's 5 s wait), and promoted however long it
            # was cut off (a chaos run's faults follow one another)
            "--repl-diskless-sync-delay",
            "0",
            "--cluster-replica-validity-factor",
            "0",
        )

    def pick_ports(self) -> None:
        super().pick_ports()
        self.bus_port = free_port()
        self.extra = self._options()

    def role(self) -> str:
        for line in self.reply("INFO", "replication").splitlines():
            if line.startswith("role:"):
                return line.split(":")[1]
        return "?"


class ClusterTopology:
    def __init__(self, workdir: Path, shards: int = 3) -> None:
        """`shards` primaries with one replica each (1: one primary holding every slot and its replica, made by
        hand since `redis-cli --cluster create` wants three primaries, for comparisons)."""
        self.dir = workdir
        self.nodes = [ClusterNodeProcess(workdir / f"node{i}") for i in range(2 * shards)]

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{n.port}" for n in self.nodes[:3]]

    def broker_section(self) -> dict[str, object]:
        """The gateway's `[broker]` keys for this topology."""
        return {"url": "", "cluster_addresses": self.addresses}

    def start(self, timeout: float = 20.0) -> None:
        for node in self.nodes:
            node.start_first()
        if len(self.nodes) == 2:
            self.create_one()
        else:
            self.create()
        deadline = time.monotonic() + timeout
        while not self.healthy():
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not become ok")
            time.sleep(0.1)

    def create_one(self) -> None:
        primary, replica = self.nodes
        self.cli(primary.port, "CLUSTER", "ADDSLOTSRANGE", "0", "16383")
        self.cli(replica.port, "CLUSTER", "MEET", "127.0.0.1", str(primary.port), str(primary.bus_port))
        primary_id = self.cli(primary.port, "CLUSTER", "MYID").strip()
        deadline = time.monotonic() + 10
        while "OK" not in self.cli(replica.port, "CLUSTER", "REPLICATE", primary_id):
            if time.monotonic() > deadline:
                raise RuntimeError("the replica did not join")
            time.sleep(0.1)

    def create(self) -> None:
        subprocess.run(
            [
                REDIS_CLI,
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in self.nodes],
                "--cluster-replicas",
                "1",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )

    def live(self) -> list[ClusterNodeProcess]:
        return [n for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def healthy(self) -> bool:
        """Every live node says `cluster_state:ok` and every live replica is in sync with its primary."""
        try:
            return all("cluster_state:ok" in n.reply("CLUSTER", "INFO") for n in self.live()) and all(
                "master_link_status:up" in n.reply("INFO", "replication") for n in self.live() if n.role() == "slave"
            )
        except OSError:
            return False

    def slot_map(self) -> list[tuple[int, int, int]]:
        """(first slot, last slot, primary's port) from a live node's CLUSTER SHARDS-like view (CLUSTER NODES)."""
        out = []
        for line in self.cli(self.live()[0].port, "CLUSTER", "NODES").splitlines():
            fields = line.split()
            if len(fields) < 8 or "master" not in fields[2] or "fail" in fields[2]:
                continue
            port = int(fields[1].split("@")[0].rsplit(":", 1)[1])
            for part in fields[8:]:
                if part.startswith("["):
                    continue
                first, _, last = part.partition("-")
                out.append((int(first), int(last or first), port))
        return out

    def primary_of(self, slot: int) -> ClusterNodeProcess:
        for first, last, port in self.slot_map():
            if first <= slot <= last:
                return next(n for n in self.nodes if n.port == port)
        raise LookupError(f"no primary holds slot {slot}")

    def primaries(self) -> list[ClusterNodeProcess]:
        ports = {port for _, _, port in self.slot_map()}
        return [n for n in self.nodes if n.port in ports]

    def cli(self, port: int, *args: str) -> str:
        done = subprocess.run([REDIS_CLI, "-p", str(port), *args], capture_output=True, text=True, timeout=10)
        return done.stdout

    def lag_replica(self, slot: int) -> ClusterNodeProcess:
        """From now on the replica of `slot`'s primary receives none of its writes (it keeps what it has):
        the primary drops its replication link and asks a password it cannot give when it reconnects (the
        connections already open, the gateway's included, stay authenticated). Returns the primary."""
        primary = self.primary_of(slot)
        if primary.command("WAIT", "1", "2000") != ":1":
            raise RuntimeError("the replica did not catch up")
        # one connection for both: once the password is set, a new connection could not run the second
        with socket.create_connection(("127.0.0.1", primary.port), timeout=2) as sock:
            sock.sendall(
                command("CONFIG", "SET", "requirepass", "replicas-keep-out") + command("CLIENT", "KILL", "TYPE", "replica")
            )
            answer = b""
            while answer.count(b"\r\n") < 2:
                answer += sock.recv(4096)
        if not answer.startswith(b"+OK\r\n:"):
            raise RuntimeError(f"could not cut the replica off: {answer!r}")
        return primary

    def kill_primary(self, slot: int) -> ClusterNodeProcess:
        """kill -9 the primary of `slot`; returns it."""
        return self.kill(self.primary_of(slot))

    def kill(self, victim: ClusterNodeProcess) -> ClusterNodeProcess:
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        victim.proc.wait(5)
        victim.proc = None
        return victim

    def wait_promoted(self, slot: int, dead: ClusterNodeProcess, timeout: float = 20.0) -> ClusterNodeProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                primary = self.primary_of(slot)
                if primary is not dead and self.healthy():
                    return primary
            except (LookupError, OSError, IndexError):
                pass
            time.sleep(0.1)
        raise RuntimeError(f"no replica took slot {slot} over")

    def move_slot(self, slot: int, target: ClusterNodeProcess) -> int:
        """Move `slot` to `target` (a primary) with its keys, as `redis-cli --cluster reshard` does. Returns
        how many keys moved."""
        source = self.primary_of(slot)
        source_id, target_id = self.cli(source.port, "CLUSTER", "MYID").strip(), self.cli(target.port, "CLUSTER", "MYID").strip()
        self.cli(target.port, "CLUSTER", "SETSLOT", str(slot), "IMPORTING", source_id)
        self.cli(source.port, "CLUSTER", "SETSLOT", str(slot), "MIGRATING", target_id)
        moved = 0
        while True:
            keys = self.cli(source.port, "CLUSTER", "GETKEYSINSLOT", str(slot), "100").split()
            if not keys:
                break
            self.cli(source.port, "MIGRATE", "127.0.0.1", str(target.port), "", "0", "5000", "KEYS", *keys)
            moved += len(keys)
        for node in (target, source, *[p for p in self.primaries() if p not in (source, target)]):
            self.cli(node.port, "CLUSTER", "SETSLOT", str(slot), "NODE", target_id)
        return moved

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()
