"""Start the gateway as a subprocess with its own temporary config and ephemeral ports; stop it after.

The contract with the gateway: ``python -m gateway serve --config FILE --ready-file PATH`` writes PATH as
JSON ``{"http_port", "ingest_port", "raw_sender_port", "raw_receiver_port"}`` once it listens. The admin
token is the one written into FILE (the ready file carries a token only when the gateway generated it).

Two configs: the load tool's own (:func:`config_text`: no per-address limits, every topic the same ring) and
the shipped one (:func:`shipped_config_text`: config/default.toml with only what a run needs overridden).
With ``workers`` > 1 (``server.workers``) the gateway needs a broker: a redis-server is started in the work
directory for the run (loadtest/redisproc.py) and stopped (wiped) after it.
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from loadtest.clusterproc import ClusterTopology
from loadtest.procstat import raise_nofile_limit
from loadtest.redisproc import RedisProcess
from loadtest.serverproc import ServerProcess
from loadtest.target import Target

HOST = "127.0.0.1"
#: a cold start imports starlette, uvicorn and the core: seconds, not minutes
STARTUP_TIMEOUT = 30.0
#: grace after SIGTERM; then a second signal (uvicorn: "force quit"), then SIGKILL after as long again
STOP_TIMEOUT = 2.0
#: the shipped ``server.max_connections`` (config/default.toml)
SHIPPED_MAX_CONNECTIONS = 10_000
#: connections beyond the clients' own a shipped run leaves room for (a storm's client may reconnect before the
#: server has seen its old connection end; anything else on the HTTP port)
CONNECTION_MARGIN = 64


def shipped_max_connections(clients: int) -> int | None:
    """``server.max_connections`` a shipped gateway needs for ``clients`` load clients: None when the shipped
    value holds them with the margin, else clients + margin."""
    need = clients + CONNECTION_MARGIN
    return need if need > SHIPPED_MAX_CONNECTIONS else None


def _workers_text(workers: int, broker_url: str | list[str]) -> tuple[str, str]:
    """The ``[server]`` lines and the ``[broker]`` section of a gateway with ``workers`` processes: on one Redis
    (its URL) or on a Redis Cluster (its seed addresses)."""
    if workers <= 1:
        return "", ""
    if isinstance(broker_url, list):
        return f"workers = {int(workers)}\n", f"[broker]\ncluster_addresses = {json.dumps(broker_url)}\n"
    return f"workers = {int(workers)}\n", f'[broker]\nurl = "{broker_url}"\n'


def shipped_config_text(
    admin_token: str, max_connections: int | None = None, workers: int = 1, broker_url: str | list[str] = ""
) -> str:
    """The gateway as shipped (config/default.toml) with only what a load run needs: ephemeral loopback
    ports, a known admin token, ``server.max_connections`` when the clients need more than the shipped
    value, and with ``workers`` > 1 the broker they need. The per-address limits and the topic rules stay as
    shipped (the clients connect from many source addresses)."""
    server, broker = _workers_text(workers, broker_url)
    raise_limit = f"max_connections = {int(max_connections)}\n" if max_connections else ""
    return f"""\
# config/default.toml as shipped; overridden only what a load run needs
[server]
port = 0
admin_token = "{admin_token}"
{raise_limit}{server}
[ingest]
port = 0

[rawtcp]
sender_port = 0
receiver_port = 0
{broker}"""


def config_text(
    admin_token: str,
    capacity: int = 64,
    batch_depth: int | str = 1,
    linger: float = 0.0,
    workers: int = 1,
    broker_url: str | list[str] = "",
) -> str:
    """The gateway config of a load run: loopback, ephemeral ports, every topic a ring of ``capacity``
    messages from which a subscription gives up to ``batch_depth`` messages per cycle (``"auto"``: a slice
    sized by its backlog), holding caught-up subscribers back ``linger`` seconds after a publish."""
    depth = '"auto"' if batch_depth == "auto" else int(batch_depth)
    server, broker = _workers_text(workers, broker_url)
    return f"""\
{broker}
[server]
host = "{HOST}"
port = 0
admin_token = "{admin_token}"
# every load client connects from this machine: a per-address limit would refuse all but the first ones
max_connections_per_ip = 0
{server}
[longpoll]
max_sessions_per_ip = 0

[ingest]
port = 0

[rawtcp]
enabled = false

[[topics.rules]]
pattern = "*"
kind = "ring"
capacity = {int(capacity)}
batch_depth = {depth}
linger = {float(linger)}
reorder_window = 64
client_publish = true
anonymous = true
# free unless a subscriber asks for deltas (--delta fossil)
delta = "fossil"

[scheduler]
cycle_budget_bytes = 65536
"""


class GatewayProcess(ServerProcess):
    """``with GatewayProcess(workdir) as target:`` runs the gateway for the block. Output goes to
    ``workdir/gateway.log``."""

    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
    stop_timeout = STOP_TIMEOUT

    def __init__(
        self,
        workdir: Path,
        command: str | None = None,
        capacity: int = 64,
        batch_depth: int | str = 1,
        linger: float = 0.0,
        env: dict[str, str] | None = None,
        *,
        shipped: bool = False,
        max_connections: int | None = None,
        workers: int = 1,
        redis: str = "single",
    ) -> None:
        self.workdir = Path(workdir)
        #: the shipped config (capacity, batch_depth and linger are then the shipped rules', not these)
        self.shipped = shipped
        #: shipped: server.max_connections raised to this (None: as shipped)
        self.max_connections = max_connections
        self.workers = workers
        #: with workers > 1: "single", one redis-server, or "cluster", 3 primaries and 3 replicas (clusterproc.py)
        self.topology = redis
        self.redis: RedisProcess | None = None
        self.cluster: ClusterTopology | None = None
        #: variables added to the gateway's environment (`GATEWAY_*` overrides)
        self.env = env or {}
        self.command = shlex.split(command) if command else [sys.executable, "-m", "gateway"]
        self.capacity = capacity
        self.batch_depth = batch_depth
        self.linger = linger
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Target:
        try:
            return self._start()
        except BaseException:
            self.stop()  # the broker too
            raise

    def _start(self) -> Target:
        self.workdir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(16)
        config = self.workdir / "gateway.toml"
        ready = self.workdir / "gateway.ready.json"
        broker_url: str | list[str] = ""
        if self.workers > 1 and self.topology == "cluster":
            self.cluster = ClusterTopology(self.workdir / "cluster")
            self.cluster.start()
            broker_url = self.cluster.addresses
        elif self.workers > 1:
            self.redis = RedisProcess(self.workdir / "redis")
            self.redis.start()
            broker_url = self.redis.url
        if self.shipped:
            config.write_text(shipped_config_text(token, self.max_connections, self.workers, broker_url))
        else:
            config.write_text(config_text(token, self.capacity, self.batch_depth, self.linger, self.workers, broker_url))
        ready.unlink(missing_ok=True)
        log = open(self.workdir / "gateway.log", "ab")
        raise_nofile_limit()
        # PYTHONSAFEPATH: `python -m` must not put the current directory first, or the checkout the run starts
        # from would shadow one that `--gateway-cmd "env PYTHONPATH=..."` names (an A/B of two checkouts).
        self.proc = subprocess.Popen(
            [*self.command, "serve", "--config", str(config), "--ready-file", str(ready)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env, "PYTHONSAFEPATH": "1"},
            preexec_fn=raise_nofile_limit,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = (self.workdir / "gateway.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"gateway exited with {self.proc.returncode} before it was ready:\n{tail}")
            if ready.exists():
                try:
                    info = json.loads(ready.read_text())
                except ValueError:  # written but not complete yet
                    info = None
                if info:
                    broker = self.redis.proc.pid if self.redis is not None and self.redis.proc else None
                    return Target("gateway", HOST, int(info["http_port"]), int(info["ingest_port"]), token, self.proc.pid, broker)
            time.sleep(0.05)
        raise TimeoutError(f"gateway not ready after {STARTUP_TIMEOUT} s (see {self.workdir}/gateway.log)")

    def stop(self) -> None:
        try:
            super().stop()
        finally:
            if self.redis is not None:
                self.redis.stop(wipe=True)
                self.redis = None
            if self.cluster is not None:
                self.cluster.stop()
                self.cluster = None
