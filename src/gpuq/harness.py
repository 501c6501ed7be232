"""Run gpuq for tests and benches: one place for every way of starting a server and agents.

- in-process: ``running_server()`` (an anyio task group, agents as ``Agent``
  objects) and ``ThreadedServer`` (its own loop in a thread, for sync clients);
- as processes: ``spawn`` with ``serve_argv``/``agent_argv``, and ``Fleet``
  (one ``gpuq serve`` and its agents, waited for through /healthz and /status);
- raw clients: ``raw_agent``/``next_of`` (a hand-driven websocket) and ``http_get``.

Everything listens on 127.0.0.1. Nothing here is used by ``gpuq serve`` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
from websockets.asyncio.client import ClientConnection, connect

from gpuq.agent import Agent
from gpuq.config import ServerConfig
from gpuq.devdb import free_port

if TYPE_CHECKING:
    from gpuq.dispatcher import Tuning

TOKEN = "test-token"
KIND = "bench"

# Tests and benches push thousands of messages a second over one connection:
# lift the per-connection abuse limits (they protect a server from a rogue
# agent, which a bench is not) so a run measures the queue, not the limiter.
UNLIMITED_ENV = {"GPUQ_MAX_MESSAGES_PER_SECOND": "10000000", "GPUQ_MAX_CONNECTIONS_PER_IP": "100000",
                 "GPUQ_MAX_CONNECTIONS": "100000"}


# --------------------------------------------------------------------------
# In-process
# --------------------------------------------------------------------------


def server_config(dsn: str, **overrides: Any) -> ServerConfig:
    """Short leases, fast polls and sweeps: what a test wants."""
    base: dict[str, Any] = dict(database_url=dsn, listen=("127.0.0.1", 0), tokens=frozenset({TOKEN}),
                                lease_seconds=30, heartbeat_seconds=5, poll_seconds=0.5, sweep_seconds=0.5,
                                drain_seconds=5)
    base.update(overrides)
    return ServerConfig(**base)


@dataclass
class Running:
    port: int
    config: ServerConfig
    stop: anyio.Event
    tg: Any
    agents: list[Agent] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/agent"

    @property
    def http(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def agent(self, kinds: list[str], capacity: int, handler: Any, name: str = "agent",
                    wait: bool = True, **described: Any) -> Agent:
        """An agent run in this task group; ``described``: its devices, labels, models (default: none)."""
        a = Agent(self.url, TOKEN, kinds, capacity, handler, name, reconnect_min=0.05, reconnect_max=0.5,
                  **{"devices": (), **described})
        self.agents.append(a)
        self.tg.start_soon(a.run)
        if wait:
            with anyio.fail_after(10):
                await a.connected.wait()
        return a


@contextlib.asynccontextmanager
async def running_server(dsn: str, tuning: Tuning | None = None, **overrides: Any) -> AsyncIterator[Running]:
    """``gpuq.server.serve`` in this task group; its agents and itself stop on exit."""
    from gpuq.dispatcher.tuning import TUNING_DEFAULT
    from gpuq.server import serve

    config = server_config(dsn, **overrides)
    stop = anyio.Event()
    ready: list[int] = []
    got_port = anyio.Event()

    def on_ready(port: int) -> None:
        ready.append(port)
        got_port.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(config, stop=stop, on_ready=on_ready, tuning=tuning or TUNING_DEFAULT))
        with anyio.fail_after(15):
            await got_port.wait()
        run = Running(ready[0], config, stop, tg)
        try:
            yield run
        finally:
            for a in run.agents:
                a.stop()
            stop.set()


class ThreadedServer:
    """``gpuq.server.serve`` on its own event loop in a thread (for sync clients)."""

    def __init__(self, dsn: str, **overrides: Any):
        self.config = server_config(dsn, **overrides)
        self.port = 0
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: anyio.Event | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, daemon=True)

    def __enter__(self) -> ThreadedServer:
        self._thread.start()
        if not self._ready.wait(30) or not self.port:
            raise RuntimeError(f"server did not start: {self._error!r}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/agent"

    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def _main(self) -> None:
        from gpuq.server import serve

        async def run() -> None:
            self._loop = asyncio.get_running_loop()
            self._stop = anyio.Event()

            def ready(port: int) -> None:
                self.port = port
                self._ready.set()

            await serve(self.config, stop=self._stop, on_ready=ready)

        try:
            anyio.run(run)
        except BaseException as exc:  # noqa: BLE001 - reported by alive() and __enter__
            self._error = exc
        finally:
            self._ready.set()


# --------------------------------------------------------------------------
# Raw clients
# --------------------------------------------------------------------------


async def raw_agent(srv: Running, kinds: tuple[str, ...] = ("embed",), capacity: int = 1,
                    name: str = "raw", **hello: Any) -> tuple[ClientConnection, dict[str, Any]]:
    """A hand-driven agent connection: hello sent (protocol 1 unless ``hello`` says otherwise), welcome read."""
    ws = await connect(srv.url, additional_headers={"Authorization": f"Bearer {TOKEN}"})
    await ws.send(json.dumps({"type": "hello", "agent": name, "kinds": list(kinds), "capacity": capacity,
                              "protocol": 1, **hello}))
    welcome = json.loads(await ws.recv())
    assert welcome["type"] == "welcome"
    return ws, welcome


async def raw_agent_with_jobs(srv: Running, db: Any, n: int) -> tuple[ClientConnection, list[dict[str, Any]]]:
    """A raw agent of capacity ``n`` and the ``n`` 'embed' jobs inserted (through ``db``) and pushed to it."""
    ws, _ = await raw_agent(srv, capacity=n)
    await db.execute("INSERT INTO gpuq.jobs (kind) SELECT 'embed' FROM generate_series(1, $1::int)", n)
    jobs: list[dict[str, Any]] = []
    while len(jobs) < n:
        jobs += (await next_of(ws, "jobs"))["jobs"]
    return ws, jobs


async def next_of(ws: ClientConnection, kind: str, timeout: float = 5) -> dict[str, Any]:
    """The next message of type ``kind`` (others are skipped)."""
    with anyio.fail_after(timeout):
        while True:
            msg = json.loads(await ws.recv())
            if msg["type"] == kind:
                return dict(msg)


def fetch(url: str, timeout: float = 5, token: str | None = None) -> tuple[int, str | None, str]:
    """(status, content type, body) of a GET (with a bearer ``token``), HTTP errors included."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as resp:  # noqa: S310 - a server on 127.0.0.1
            return resp.status, resp.headers.get("Content-Type"), resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers.get("Content-Type"), err.read().decode()


async def http_get(url: str, token: str | None = None) -> tuple[int, str | None, str]:
    return await anyio.to_thread.run_sync(lambda: fetch(url, token=token))


def http_json(port: int, path: str, token: str | None = TOKEN) -> dict[str, Any]:
    """A JSON endpoint of a server on 127.0.0.1 (read with ``token``), or {} when it does not answer."""
    try:
        return dict(json.loads(fetch(f"http://127.0.0.1:{port}{path}", timeout=2, token=token)[2]))
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------


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

    def kill(self) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGKILL)
            self.popen.wait(10)

    def stop(self, timeout: float = 15.0) -> None:
        if self.alive():
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(5)


def spawn(name: str, argv: list[str], logdir: Path, env: dict[str, str] | None = None) -> Proc:
    """``python argv...`` with its output in ``logdir/name.log``."""
    log = logdir / f"{name}.log"
    with open(log, "wb") as fh:
        popen = subprocess.Popen([sys.executable, *argv], stdout=fh, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=dict(os.environ, **(env or {})))
    return Proc(name, popen, log)


def serve_argv(dsn: str, port: int, token: str = TOKEN, **flags: Any) -> list[str]:
    """``gpuq serve`` on 127.0.0.1:port, JSON logs at warning; ``flags`` as ``--name value``."""
    return ["-m", "gpuq.cli", "serve", "--database-url", dsn, "--listen", f"127.0.0.1:{port}",
            "--tokens", token, "--log-level", "warning", "--log-format", "json", *_flags(flags)]


def agent_argv(url: str, name: str, handler: str | None, capacity: int, kinds: str = KIND,
               token: str = TOKEN, **flags: Any) -> list[str]:
    """``gpuq agent`` with JSON logs at warning; ``handler`` None: none (a batch handler in ``flags``
    takes single jobs too); ``flags`` as ``--name value``."""
    return ["-m", "gpuq.cli", "agent", "--url", url, "--token", token, "--kinds", kinds,
            "--capacity", str(capacity), *(["--handler", handler] if handler else []), "--name", name,
            "--log-level", "warning", "--log-format", "json", *_flags(flags)]


def _flags(flags: dict[str, Any]) -> list[str]:
    return [a for k, v in flags.items() if v is not None for a in (f"--{k.replace('_', '-')}", str(v))]


@dataclass
class Fleet:
    """One ``gpuq serve`` process and its agents."""

    dsn: str
    port: int = field(default_factory=free_port)
    logdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gpuq-logs-")))
    serve: Proc | None = None
    agents: list[Proc] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/agent"

    def start_serve(self, env: dict[str, str] | None = None, **flags: Any) -> None:
        self.serve = spawn("serve", serve_argv(self.dsn, self.port, **flags), self.logdir,
                           {**UNLIMITED_ENV, **(env or {})})
        self.wait(lambda: bool(http_json(self.port, "/healthz").get("ok")), 30, "serve /healthz")

    def start_agents(self, n: int, capacity: int, handler: str | None = "gpuq.demo:noop",
                     env: dict[str, str] | None = None, kinds: str = KIND, prefix: str = "bench",
                     **flags: Any) -> None:
        """n agent processes; ``flags``: more of ``gpuq agent``'s, as ``--name value``."""
        for i in range(n):
            argv = agent_argv(self.url, f"{prefix}-{i}", handler, capacity, kinds, **flags)
            self.agents.append(spawn(f"agent-{i}", argv, self.logdir, env))
        self.wait_connected(n)

    def start_swarm(self, n: int, per_process: int, capacity: int = 1, handler: str = "gpuq.demo:noop") -> None:
        """n agents, ``per_process`` of them in each process (one event loop each)."""
        for i, lo in enumerate(range(0, n, per_process)):
            argv = ["-m", "gpuq.bench.swarm", "--url", self.url, "--token", TOKEN, "--kinds", KIND,
                    "--count", str(min(per_process, n - lo)), "--first", str(lo), "--capacity", str(capacity),
                    "--handler", handler]
            self.agents.append(spawn(f"swarm-{i}", argv, self.logdir))

    def wait_connected(self, n: int, timeout: float = 120.0) -> None:
        self.wait(lambda: http_json(self.port, "/status").get("agents_connected", 0) >= n, timeout,
                  f"{n} agents connected")

    def check(self) -> None:
        """Raise, with its log, if a process of the fleet has exited."""
        for p in [self.serve, *self.agents]:
            if p is not None and not p.alive():
                raise RuntimeError(f"{p.name} exited ({p.popen.returncode}); its log:\n{p.tail()}")

    def wait(self, ok: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check()
            if ok():
                return
            time.sleep(0.05)
        raise RuntimeError(f"timed out waiting for {what}; serve log:\n{self.serve.tail() if self.serve else ''}")

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
