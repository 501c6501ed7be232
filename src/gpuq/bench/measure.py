"""What the benches measure besides time: CPU seconds, memory, error lines, percentiles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpuq.bench.common import queries

ERROR_LEVELS = {"error", "critical", "exception", "fatal"}


def cpu_seconds(pids: list[int]) -> float:
    """user+system CPU seconds of these processes and their children so far."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            p = psutil.Process(pid)
            procs = [p, *p.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
        for q in procs:
            try:
                t = q.cpu_times()
                total += t.user + t.system
            except psutil.NoSuchProcess:
                continue
    return total


class CpuMeter:
    """CPU seconds of named groups of processes between ``start()`` and ``stop()``."""

    def __init__(self, groups: dict[str, list[int]]):
        self.groups = {k: v for k, v in groups.items() if v}
        self._t0: dict[str, float] = {}
        self.used: dict[str, float | None] = dict.fromkeys(groups)

    def start(self) -> None:
        self._t0 = {k: cpu_seconds(v) for k, v in self.groups.items()}

    def stop(self) -> dict[str, float | None]:
        for k, pids in self.groups.items():
            self.used[k] = round(cpu_seconds(pids) - self._t0[k], 2)
        return self.used


def rss_mb(pid: int) -> float:
    import psutil

    return float(psutil.Process(pid).memory_info().rss) / (1 << 20)


async def postmaster_pid(conn: Any) -> int | None:
    """The local PostgreSQL server's pid (None when the server is not on this machine)."""
    try:
        data_dir = await conn.fetchval(queries["data_directory"])
        pid = int(Path(data_dir, "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError, TypeError):
        return None
    import psutil

    return pid if psutil.pid_exists(pid) else None


def count_errors(log_text: str) -> tuple[int, list[str]]:
    """ERROR-level JSON lines and traceback starts in a log; (count, first few lines)."""
    errors: list[str] = []
    for line in log_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("{"):
            try:
                obj = json.loads(stripped)
            except ValueError:
                continue
            if isinstance(obj, dict) and str(obj.get("level", "")).lower() in ERROR_LEVELS:
                errors.append(stripped)
        elif stripped.startswith("Traceback"):
            errors.append(stripped)
    return len(errors), errors[:5]


def percentiles(values_ms: list[float]) -> dict[str, float]:
    xs = sorted(values_ms)
    if not xs:
        return {}

    def pct(p: float) -> float:
        return round(xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))], 3)

    return {"p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99), "max_ms": round(xs[-1], 3)}
