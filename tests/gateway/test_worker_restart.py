"""The restart figures of the supervisor of `server.workers` (gateway/workers/supervisor.py, docs/cluster.md
§5): at once after a first death, then 0.5 s doubling up to 10 s; and how a death is said. The restarts
themselves, with real processes: tests/cluster/test_worker_restart.py."""

from __future__ import annotations

import os
import signal

from gateway.workers import supervisor
from gateway.workers.supervisor import describe_status, restart_delay


def test_the_first_restart_is_at_once_then_the_delay_doubles_from_half_a_second_up_to_10_s() -> None:
    assert [restart_delay(n) for n in range(1, 10)] == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]
    assert restart_delay(1000) == 10.0  # no overflow however long the streak
    assert (
        supervisor.RESTART_DELAY_MIN_S,
        supervisor.RESTART_DELAY_MAX_S,
        supervisor.STABLE_S,
        supervisor.MAX_START_FAILURES,
    ) == (0.5, 10.0, 30.0, 5)  # the figures docs/cluster.md §5 gives


def test_a_death_is_said_by_its_signal_or_its_exit_status() -> None:
    pid = os.fork()
    if pid == 0:
        os.kill(os.getpid(), signal.SIGKILL)
    _, killed = os.waitpid(pid, 0)
    pid = os.fork()
    if pid == 0:
        os._exit(3)
    _, ended = os.waitpid(pid, 0)
    assert (describe_status(killed), describe_status(ended)) == ("killed by SIGKILL", "ended with status 3")
