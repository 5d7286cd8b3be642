"""redis-server for the load tool's cluster runs and the cluster tests: a free loopback port, restartable on it
(with its data, or wiped), stoppable with SIGSTOP. No persistence unless `appendonly` (then an append-only
file fsynced on every write, so a restart keeps everything Redis acknowledged)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from .ports import free_port

#: where Debian installs it (`make redis`); else whatever `redis-server` is on the PATH
REDIS_SERVER = "/usr/bin/redis-server"


def redis_binary() -> str | None:
    return REDIS_SERVER if Path(REDIS_SERVER).exists() else shutil.which("redis-server")


class RedisProcess:
    def __init__(self, workdir: Path, *, appendonly: bool = False, extra: tuple[str, ...] = ()) -> None:
        self.dir = workdir
        self.appendonly = appendonly
        #: more redis-server options (`--replicaof HOST PORT`, cluster mode)
        self.extra = extra
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start (again, on the same port and directory) and wait until it answers PING."""
        self.dir.mkdir(parents=True, exist_ok=True)
        persistence = ["--appendonly", "yes", "--appendfsync", "always"] if self.appendonly else ["--appendonly", "no"]
        binary = redis_binary() or REDIS_SERVER
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                *persistence,
                "--dir",
                str(self.dir),
                *self.extra,
            ],
            stdout=open(self.dir / "redis.log", "ab"),
            stderr=subprocess.STDOUT,
        )
        self.wait_for_pong("redis-server")

    def start_first(self, attempts: int = 3) -> None:
        """The first `start`, on fresh free ports again when one was taken between `free_port` and the
        server's bind (another process got it meanwhile): only before anything knows the ports."""
        for attempt in range(attempts):
            try:
                self.start()
                return
            except RuntimeError:
                if attempt == attempts - 1 or "Address already in use" not in self.log_tail():
                    raise
                self.pick_ports()

    def pick_ports(self) -> None:
        """Free ports again for a server that never listened."""
        self.port = free_port()

    def wait_for_pong(self, what: str) -> None:
        """Until the server answers PING (15 s at most)."""
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            try:
                if self.command("PING") == "+PONG":
                    return
            except OSError:
                pass
            if self.proc is not None and self.proc.poll() is not None:
                break  # it exited: waiting longer cannot help
            time.sleep(0.02)
        raise RuntimeError(f"{what} on port {self.port} did not start: {self.log_tail()}")

    def log_tail(self, lines: int = 5) -> str:
        """The last lines it logged (why it did not start)."""
        try:
            return " | ".join((self.dir / "redis.log").read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "no log"

    def reply(self, *args: str) -> str:
        """One command's whole reply, as text (a bulk string's body included: `INFO`)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=2) as sock:
            sock.sendall(("*%d\r\n" % len(args) + "".join(f"${len(a)}\r\n{a}\r\n" for a in args)).encode())
            data = b""
            while True:
                chunk = sock.recv(65536)
                data += chunk
                if not chunk or data.endswith(b"\r\n") and (not data.startswith(b"$") or data.count(b"\r\n") >= 2):
                    return data.decode(errors="replace")

    def command(self, *args: str) -> str:
        """One command, its first reply line (enough for PING, SAVE, CLIENT KILL, HSET)."""
        return self.reply(*args).split("\r\n")[0]

    def used_memory(self) -> int | None:
        try:
            for line in self.reply("INFO", "memory").splitlines():
                if line.startswith("used_memory:"):
                    return int(line.split(":")[1])
        except OSError:
            return None
        return None

    def stall(self, stopped: bool) -> None:
        """SIGSTOP (`stopped`) or SIGCONT: the process keeps its sockets and data but answers nothing."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGSTOP if stopped else signal.SIGCONT)

    def stop(self, wipe: bool = False) -> None:
        """Kill it (-9: nothing more is written); `wipe`: its data goes too, so a start is an empty Redis."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None
        if wipe:
            for name in ("appendonlydir", "appendonly.aof", "dump.rdb"):
                path = self.dir / name
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
