"""Run a real gpuq server (and agents) in-process on 127.0.0.1 for tests, and talk to it raw."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
from websockets.asyncio.client import ClientConnection, connect

from gpuq.agent import Agent
from gpuq.config import ServerConfig
from gpuq.server import serve

TOKEN = "test-token"


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
                    wait: bool = True) -> Agent:
        a = Agent(self.url, TOKEN, kinds, capacity, handler, name, reconnect_min=0.05, reconnect_max=0.5)
        self.agents.append(a)
        self.tg.start_soon(a.run)
        if wait:
            with anyio.fail_after(10):
                await a.connected.wait()
        return a


def server_config(dsn: str, **overrides: Any) -> ServerConfig:
    base: dict[str, Any] = dict(database_url=dsn, listen=("127.0.0.1", 0), tokens=frozenset({TOKEN}),
                                lease_seconds=30, heartbeat_seconds=5, poll_seconds=0.5, sweep_seconds=0.5,
                                drain_seconds=5)
    base.update(overrides)
    return ServerConfig(**base)


@contextlib.asynccontextmanager
async def running_server(dsn: str, **overrides: Any) -> AsyncIterator[Running]:
    config = server_config(dsn, **overrides)
    stop = anyio.Event()
    ready: list[int] = []
    got_port = anyio.Event()

    def on_ready(port: int) -> None:
        ready.append(port)
        got_port.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(config, stop=stop, on_ready=on_ready))
        with anyio.fail_after(15):
            await got_port.wait()
        run = Running(ready[0], config, stop, tg)
        try:
            yield run
        finally:
            for a in run.agents:
                a.stop()
            stop.set()


async def raw_agent(srv: Running, kinds: tuple[str, ...] = ("embed",), capacity: int = 1,
                    name: str = "raw") -> tuple[ClientConnection, dict[str, Any]]:
    """A hand-driven agent connection: hello sent, welcome read."""
    ws = await connect(srv.url, additional_headers={"Authorization": f"Bearer {TOKEN}"})
    await ws.send(json.dumps({"type": "hello", "agent": name, "kinds": list(kinds), "capacity": capacity,
                              "protocol": 1}))
    welcome = json.loads(await ws.recv())
    assert welcome["type"] == "welcome"
    return ws, welcome


async def next_of(ws: ClientConnection, kind: str, timeout: float = 5) -> dict[str, Any]:
    """The next message of type ``kind`` (others are skipped)."""
    with anyio.fail_after(timeout):
        while True:
            msg = json.loads(await ws.recv())
            if msg["type"] == kind:
                return dict(msg)


async def http_get(url: str) -> tuple[int, str | None, str]:
    """(status, content type, body) of a GET, errors included."""
    def fetch() -> tuple[int, str | None, str]:
        try:
            with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - a test server on 127.0.0.1
                return resp.status, resp.headers.get("Content-Type"), resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.headers.get("Content-Type"), err.read().decode()

    return await anyio.to_thread.run_sync(fetch)
