"""Run a real gpuq server (and agents) in-process on 127.0.0.1 for tests."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio

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
