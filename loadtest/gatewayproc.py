"""Start the gateway as a subprocess with its own temporary config and ephemeral ports; stop it after.

The contract with the gateway: ``python -m gateway serve --config FILE --ready-file PATH`` writes PATH as
JSON ``{"http_port", "ingest_port", "raw_sender_port", "raw_receiver_port"}`` once it listens. The admin
token is the one written into FILE (the ready file carries a token only when the gateway generated it).
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

from loadtest.procstat import raise_nofile_limit
from loadtest.serverproc import ServerProcess
from loadtest.target import Target

HOST = "127.0.0.1"
#: a cold start imports starlette, uvicorn and the core: seconds, not minutes
STARTUP_TIMEOUT = 30.0
#: grace after SIGTERM; then a second signal (uvicorn: "force quit"), then SIGKILL after as long again
STOP_TIMEOUT = 2.0


def config_text(admin_token: str, capacity: int = 64, batch_depth: int | str = 1, linger: float = 0.0) -> str:
    """The gateway config of a load run: loopback, ephemeral ports, every topic a ring of ``capacity``
    messages from which a subscription gives up to ``batch_depth`` messages per cycle (``"auto"``: a slice
    sized by its backlog), holding caught-up subscribers back ``linger`` seconds after a publish."""
    depth = '"auto"' if batch_depth == "auto" else int(batch_depth)
    return f"""\
[server]
host = "{HOST}"
port = 0
admin_token = "{admin_token}"
# every load client connects from this machine: a per-address limit would refuse all but the first ones
max_connections_per_ip = 0

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

[scheduler]
cycle_budget_bytes = 65536
"""


class GatewayProcess(ServerProcess):
    """``with GatewayProcess(workdir) as target:`` runs the gateway for the block. Output goes to
    ``workdir/gateway.log``."""

    stop_signals = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
    stop_timeout = STOP_TIMEOUT

    def __init__(self, workdir: Path, command: str | None = None, capacity: int = 64,
                 batch_depth: int | str = 1, linger: float = 0.0, env: dict[str, str] | None = None) -> None:
        self.workdir = Path(workdir)
        #: variables added to the gateway's environment (`GATEWAY_*` overrides)
        self.env = env or {}
        self.command = shlex.split(command) if command else [sys.executable, "-m", "gateway"]
        self.capacity = capacity
        self.batch_depth = batch_depth
        self.linger = linger
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Target:
        self.workdir.mkdir(parents=True, exist_ok=True)
        token = secrets.token_hex(16)
        config = self.workdir / "gateway.toml"
        ready = self.workdir / "gateway.ready.json"
        config.write_text(config_text(token, self.capacity, self.batch_depth, self.linger))
        ready.unlink(missing_ok=True)
        log = open(self.workdir / "gateway.log", "ab")
        raise_nofile_limit()
        # PYTHONSAFEPATH: `python -m` must not put the current directory first, or the checkout the run starts
        # from would shadow one that `--gateway-cmd "env PYTHONPATH=..."` names (an A/B of two checkouts).
        self.proc = subprocess.Popen(
            [*self.command, "serve", "--config", str(config), "--ready-file", str(ready)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env, "PYTHONSAFEPATH": "1"}, preexec_fn=raise_nofile_limit, start_new_session=True)
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
                    return Target("gateway", HOST, int(info["http_port"]), int(info["ingest_port"]),
                                  token, self.proc.pid)
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"gateway not ready after {STARTUP_TIMEOUT} s (see {self.workdir}/gateway.log)")
