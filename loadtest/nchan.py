"""nginx + nchan as the reference target of ``python -m loadtest compare``.

:func:`ensure_installed` installs Debian's ``nginx`` and ``libnginx-mod-nchan`` with apt-get when they are
missing (only the compare command calls it). :class:`NchanServer` renders ``nchan.conf.template`` into a
work directory and runs nginx in the foreground on a free loopback port for the duration of a run.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from string import Template

from rich.console import Console

from loadtest.procstat import raise_nofile_limit
from loadtest.serverproc import ServerProcess
from loadtest.target import Target

from .ports import free_port

PACKAGES = ("nginx", "libnginx-mod-nchan")
MODULE = Path("/usr/lib/nginx/modules/ngx_nchan_module.so")
TEMPLATE = Path(__file__).with_name("nchan.conf.template")
HOST = "127.0.0.1"
STARTUP_TIMEOUT = 15.0
STOP_TIMEOUT = 5.0
POLICY_RC = Path("/usr/sbin/policy-rc.d")


def nginx_binary() -> str | None:
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if Path(p).exists()), None)


def installed() -> bool:
    return nginx_binary() is not None and MODULE.exists()


def ensure_installed(console: Console) -> None:
    """apt-get install nginx and nchan when missing, without letting the package start its own service."""
    if installed():
        return
    if os.geteuid() != 0:
        raise RuntimeError(f"nginx with nchan is missing; install {' '.join(PACKAGES)} (needs root)")
    console.print(f"installing {' '.join(PACKAGES)} with apt-get")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    # policy-rc.d exit 101: the Debian way to tell maintainer scripts not to start services
    made_policy = not POLICY_RC.exists()
    if made_policy:
        POLICY_RC.write_text("#!/bin/sh\nexit 101\n")
        POLICY_RC.chmod(0o755)
    try:
        subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
        )
    finally:
        if made_policy:
            POLICY_RC.unlink(missing_ok=True)
    if not installed():
        raise RuntimeError(f"installed {PACKAGES} but {MODULE} or nginx is still missing")


def config_text(prefix: Path, port: int, capacity: int = 64, deflate: bool = False) -> str:
    """``deflate``: nchan keeps a compressed copy of each message for the WebSocket clients that negotiated
    permessage-deflate (its own compress-once)."""
    nofile = raise_nofile_limit()
    return Template(TEMPLATE.read_text()).substitute(
        module=str(MODULE),
        prefix=str(prefix),
        port=port,
        capacity=capacity,
        nofile=nofile,
        connections=max(1024, nofile - 100),
        deflate="on" if deflate else "off",
    )


class NchanServer(ServerProcess):
    """``with NchanServer(workdir) as target:`` runs nginx + nchan for the block (logs in workdir/nginx)."""

    stop_signals = (signal.SIGTERM, signal.SIGKILL)  # SIGTERM: nginx's fast shutdown
    stop_timeout = STOP_TIMEOUT

    def __init__(self, workdir: Path, capacity: int = 64, deflate: bool = False) -> None:
        self.prefix = Path(workdir).resolve() / "nginx"
        self.capacity = capacity
        self.deflate = deflate
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Target:
        binary = nginx_binary()
        if binary is None or not MODULE.exists():
            raise RuntimeError("nginx with nchan is not installed")
        self.prefix.mkdir(parents=True, exist_ok=True)
        port = free_port()
        conf = self.prefix / "nginx.conf"
        conf.write_text(config_text(self.prefix, port, self.capacity, self.deflate))
        log = open(self.prefix / "stderr.log", "ab")
        self.proc = subprocess.Popen(
            [binary, "-p", str(self.prefix), "-c", str(conf)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            preexec_fn=raise_nofile_limit,
            start_new_session=True,
        )
        log.close()
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                errors = self.prefix / "error.log"
                tail = errors.read_text(errors="replace")[-2000:] if errors.exists() else ""
                raise RuntimeError(f"nginx exited with {self.proc.returncode}:\n{tail}")
            try:
                socket.create_connection((HOST, port), timeout=0.5).close()
                return Target("nchan", HOST, port, pid=self.proc.pid)
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nginx not listening after {STARTUP_TIMEOUT} s")
