"""Real processes for the end-to-end benches: ``gpuq serve``, agents, CPU accounting.

Everything runs as a subprocess of ``sys.executable -m gpuq.cli ...`` (or
``-m gpuq.bench.swarm`` for many agents in one process) on 127.0.0.1, with
its logs in a temporary directory (printed when a process fails).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuq.devdb import free_port

TOKEN = "bench-token"
KIND = "bench"

# Benches push thousands of messages per second over one connection: lift the
# per-connection abuse limit (it protects a server from a rogue agent, which
# a bench is not) so it measures the queue, not the limiter.
SERVE_ENV = {"GPUQ_MAX_MESSAGES_PER_SECOND": "10000000", "GPUQ_MAX_CONNECTIONS_PER_IP": "100000",
             "GPUQ_MAX_CONNECTIONS": "100000"}


def _logdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="gpuq-bench-logs-"))


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, timeout: float = 15.0) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def spawn(name: str, argv: list[str], logdir: Path, env: dict[str, str] | None = None) -> Proc:
    log = logdir / f"{name}.log"
    full_env = dict(os.environ, **(env or {}))
    with open(log, "wb") as fh:
        popen = subprocess.Popen([sys.executable, *argv], stdout=fh, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=full_env)
    return Proc(name, popen, log)


@dataclass
class Fleet:
    """One ``gpuq serve`` and its agents."""

    dsn: str
    port: int = field(default_factory=free_port)
    logdir: Path = field(default_factory=_logdir)
    serve: Proc | None = None
    agents: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/agent"

    def start_serve(self, poll_seconds: float | None = None, max_batch: int | None = None) -> None:
        argv = ["-m", "gpuq.cli", "serve", "--database-url", self.dsn,
                "--listen", f"127.0.0.1:{self.port}", "--tokens", TOKEN, "--log-level", "warning",
                "--log-format", "json"]
        if poll_seconds is not None:
            argv += ["--poll-seconds", str(poll_seconds)]
        env = dict(SERVE_ENV)
        if max_batch is not None:
            env["GPUQ_MAX_BATCH"] = str(max_batch)
        self.serve = spawn("serve", argv, self.logdir, env)
        self._wait(lambda: bool(self.http_json("/healthz").get("ok")), 30, "serve /healthz")

    def start_agents(self, n: int, capacity: int, handler: str = "gpuq.demo:noop") -> None:
        for i in range(n):
            self.agents.append(spawn(
                f"agent-{i}",
                ["-m", "gpuq.cli", "agent", "--url", self.url, "--token", TOKEN, "--kinds", KIND,
                 "--capacity", str(capacity), "--handler", handler, "--name", f"bench-{i}",
                 "--log-level", "warning", "--log-format", "json"],
                self.logdir))
        self.wait_connected(n)

    def start_swarm(self, n: int, per_process: int, capacity: int = 1,
                    handler: str = "gpuq.demo:noop") -> None:
        """n agents, ``per_process`` of them in each process (one event loop each)."""
        for i, lo in enumerate(range(0, n, per_process)):
            k = min(per_process, n - lo)
            self.agents.append(spawn(
                f"swarm-{i}",
                ["-m", "gpuq.bench.swarm", "--url", self.url, "--token", TOKEN, "--kinds", KIND,
                 "--count", str(k), "--first", str(lo), "--capacity", str(capacity),
                 "--handler", handler],
                self.logdir))

    def wait_connected(self, n: int, timeout: float = 120.0) -> float:
        t0 = time.perf_counter()
        self._wait(lambda: self.http_json("/status").get("agents_connected", 0) >= n, timeout,
                   f"{n} agents connected")
        return time.perf_counter() - t0

    def http_json(self, path: str) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as r:  # noqa: S310
                return dict(json.loads(r.read()))
        except (OSError, ValueError):
            return {}

    def _wait(self, ok: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for p in [self.serve, *self.agents]:
                if p is not None and not p.alive():
                    raise RuntimeError(f"{p.name} exited ({p.popen.returncode}) while waiting for "
                                       f"{what}; its log:\n{p.tail()}")
            if ok():
                return
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what}; serve log:\n"
                           f"{self.serve.tail() if self.serve else ''}")

    def stop(self) -> None:
        for a in self.agents:
            if a.alive():
                a.popen.send_signal(signal.SIGTERM)
        for a in self.agents:
            a.stop(10)
        if self.serve is not None:
            self.serve.stop(20)

    def pids(self) -> dict[str, list[int]]:
        return {"serve": [self.serve.popen.pid] if self.serve else [],
                "agents": [a.popen.pid for a in self.agents]}


# --------------------------------------------------------------------------
# CPU and memory
# --------------------------------------------------------------------------


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


def rss_mb(pid: int) -> float:
    import psutil

    return psutil.Process(pid).memory_info().rss / (1 << 20)


_DATA_DIR = "SELECT setting FROM pg_settings WHERE name = 'data_directory'"


async def postmaster_pid(conn: Any) -> int | None:
    """The local PostgreSQL server's pid (None when the server is not on this machine)."""
    try:
        data_dir = await conn.fetchval(_DATA_DIR)
        pid = int(Path(data_dir, "postmaster.pid").read_text().split("\n", 1)[0])
    except (OSError, ValueError, TypeError):
        return None
    try:
        import psutil

        return pid if psutil.pid_exists(pid) else None
    except ImportError:
        return None
