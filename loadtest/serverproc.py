"""What the load tool's server subprocesses share: stopping the process group, the ``with`` block."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from loadtest.target import Target


class ServerProcess:
    """A server run as a subprocess in its own session (``start_new_session=True``): ``with X(...) as
    target:`` starts it for the block; `stop` sends its process group each of `stop_signals` in turn,
    waiting `stop_timeout` seconds after each, then waits for the end."""

    stop_signals: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGKILL)
    stop_timeout = 2.0
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Target:
        raise NotImplementedError

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        for sig in self.stop_signals:
            os.killpg(proc.pid, sig)
            try:
                proc.wait(self.stop_timeout)
                return
            except subprocess.TimeoutExpired:
                continue
        proc.wait()

    def __enter__(self) -> Target:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
