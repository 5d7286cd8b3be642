"""CPU time and memory of a process tree, read from /proc (Linux), and the open-files limit.

CPU figures are in CPU-seconds; a share of 100% is one core busy for the whole window.
"""

from __future__ import annotations

import os
import resource
import time
from dataclasses import dataclass, field

_CLK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def raise_nofile_limit() -> int:
    """Raise this process's open-files soft limit to the hard limit (children inherit it); returns it."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return hard
    return soft


def read_stat(pid: int) -> tuple[int, float, int] | None:
    """(ppid, utime + stime in seconds, rss bytes) of ``pid``, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'
    rest = raw[raw.rfind(b")") + 2 :].split()
    return int(rest[1]), (int(rest[11]) + int(rest[12])) / _CLK, int(rest[21]) * _PAGE


def peak_rss(pid: int) -> int:
    """VmHWM (peak resident set) of ``pid`` in bytes, 0 when unknown."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree(root: int, exclude: int | tuple[int, ...] | None = None) -> list[int]:
    """``root`` and all its live descendants, less the subtree of ``exclude`` (a pid or several)."""
    skip = set(exclude) if isinstance(exclude, tuple) else {exclude}
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        stat = read_stat(int(name))
        if stat is not None:
            children.setdefault(stat[0], []).append(int(name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in skip:
            continue
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


@dataclass(slots=True)
class TreeSampler:
    """Samples the CPU time and RSS of a process tree. Call :meth:`sample` periodically.

    A process that exits keeps the last CPU time seen for it, so the totals never go backwards.
    """

    root: int
    #: subtrees not to count (the server and its broker, when they are our children)
    exclude: int | tuple[int, ...] | None = None
    cpu_by_pid: dict[int, float] = field(default_factory=dict)
    samples: list[tuple[float, float, int]] = field(default_factory=list)  # (wall, cpu s, rss bytes)
    #: per sample: CPU seconds of each pid seen so far
    per_pid: list[dict[int, float]] = field(default_factory=list)

    def sample(self) -> tuple[float, float, int]:
        rss = 0
        for pid in tree(self.root, self.exclude):
            stat = read_stat(pid)
            if stat is None:
                continue
            self.cpu_by_pid[pid] = max(self.cpu_by_pid.get(pid, 0.0), stat[1])
            rss += stat[2]
        point = (time.monotonic(), sum(self.cpu_by_pid.values()), rss)
        self.samples.append(point)
        self.per_pid.append(dict(self.cpu_by_pid))
        return point

    def pids_pct(self, t0: float, t1: float, pids: list[int]) -> float:
        """CPU share (% of one core) of the given processes (and no others) between the samples nearest
        ``t0`` and ``t1``."""
        inside = [i for i, s in enumerate(self.samples) if t0 - 0.5 <= s[0] <= t1 + 0.5]
        if len(inside) < 2:
            return 0.0
        before, after = self.per_pid[inside[0]], self.per_pid[inside[-1]]
        wall = max(self.samples[inside[-1]][0] - self.samples[inside[0]][0], 1e-9)
        cpu = sum(after.get(p, 0.0) - before.get(p, 0.0) for p in pids)
        return round(100 * cpu / wall, 1)

    def window(self, t0: float, t1: float) -> dict[str, float]:
        """CPU share (% of one core) between the samples nearest ``t0`` and ``t1``, the share of the busiest
        single process, and the max RSS then."""
        inside = [i for i, s in enumerate(self.samples) if t0 - 0.5 <= s[0] <= t1 + 0.5]
        if len(inside) < 2:
            return {"cpu_pct": 0.0, "cpu_s": 0.0, "rss_max_mb": 0.0, "busiest_pct": 0.0}
        first, last = self.samples[inside[0]], self.samples[inside[-1]]
        wall = max(last[0] - first[0], 1e-9)
        cpu = last[1] - first[1]
        before, after = self.per_pid[inside[0]], self.per_pid[inside[-1]]
        busiest = max((after[p] - before.get(p, 0.0) for p in after), default=0.0)
        return {
            "cpu_pct": round(100 * cpu / wall, 1),
            "cpu_s": round(cpu, 3),
            "rss_max_mb": round(max(self.samples[i][2] for i in inside) / 2**20, 1),
            # one process near 100% is a bottleneck whatever the total says
            "busiest_pct": round(100 * busiest / wall, 1),
        }


def tree_rss(root: int) -> int:
    """Resident bytes of ``root`` and its live descendants (a gateway's supervisor and workers; nginx's
    master and worker)."""
    return sum(stat[2] for pid in tree(root) if (stat := read_stat(pid)) is not None)


def machine_cpu() -> float:
    """CPU seconds the whole machine spent busy (all cores, not idle or iowait) since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields[:8]) - fields[3] - fields[4]  # user nice system idle iowait irq softirq steal
    return busy / _CLK


@dataclass(slots=True)
class MachineSampler:
    """Samples the machine's busy CPU time, to tell how much of it neither the server nor the load used
    (another program on the machine skews a run)."""

    samples: list[tuple[float, float]] = field(default_factory=list)

    def sample(self) -> None:
        self.samples.append((time.monotonic(), machine_cpu()))

    def window(self, t0: float, t1: float) -> float:
        """Busy CPU, % of one core (all cores: up to cores x 100), between the samples nearest t0 and t1."""
        inside = [s for s in self.samples if t0 - 0.5 <= s[0] <= t1 + 0.5]
        if len(inside) < 2:
            return 0.0
        return round(100 * (inside[-1][1] - inside[0][1]) / max(inside[-1][0] - inside[0][0], 1e-9), 1)


def wait_quiet(limit_s: float, threshold_pct: float = 15.0, period_s: float = 1.0) -> tuple[bool, float]:
    """Wait, at most ``limit_s`` seconds, until the whole machine is busy less than ``threshold_pct`` of one
    core over ``period_s``: another program running beside a run skews it. Returns (quiet, last busy %)."""
    deadline = time.monotonic() + limit_s
    busy = 0.0
    while True:
        t0, c0 = time.monotonic(), machine_cpu()
        time.sleep(period_s)
        busy = 100 * (machine_cpu() - c0) / max(time.monotonic() - t0, 1e-9)
        if busy < threshold_pct:
            return True, round(busy, 1)
        if time.monotonic() >= deadline:
            return False, round(busy, 1)
