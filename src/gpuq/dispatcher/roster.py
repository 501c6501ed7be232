"""Roster: this server's agents written to ``gpuq.fleet_agents``, and the other servers' read back.

Placement leases only for this server's own agents, from memory; but "warm
somewhere" (the warm wait) and "unplaceable" (``/status``) are questions about
the whole fleet, and with several ``gpuq serve`` on one database the agent that
holds a model warm, or the one that fits, may be connected to another server.
So each server keeps a row per connected agent (migration 0016):

- written on the agent's events (hello, models or labels changed, drain) and
  deleted on its disconnect, by a background task: the server's reader only
  queues (``put``, ``drop``), never waits on the database;
- every ``fleet_refresh_seconds`` the server marks its rows seen; when fewer
  are there than it has agents (a failover or a crash emptied the unlogged
  table), it writes them all again; the same refresh prunes every row not seen
  for ``fleet_stale_seconds`` (a server that crashed);
- readers ignore rows older than ``fleet_stale_seconds`` and read at most
  every ``fleet_read_seconds`` (``others()``): never once per job.
"""

from __future__ import annotations

import os
import secrets
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import anyio

from gpuq import db, logs
from gpuq.dispatcher.sessions import AgentSession
from gpuq.dispatcher.tuning import Tuning
from gpuq.dispatcher.writer import Writer
from gpuq.loops import Outage, run_every
from gpuq.protocol import Device
from gpuq.sql import queries

log = logs.get("dispatcher")


@dataclass
class FleetAgent:
    """An agent of another server, as its row says: what placement reads of a ``Candidate``,
    with nothing free (this server never leases for it)."""

    id: str
    server: str
    kinds: frozenset[str]
    version: int
    devices: tuple[Device, ...]
    models: frozenset[str]
    labels: frozenset[str]
    draining: bool
    free: int = 0

    def free_devices(self, min_memory_mb: int = 0) -> list[int]:
        return []

    def ready_devices(self, min_memory_mb: int = 0) -> list[int]:
        return []


class Roster(Writer):
    failed_event = "fleet.write_failed"

    def __init__(self, pool: Any, tuning: Tuning, sessions: Iterable[AgentSession]):
        super().__init__()
        self.pool, self.tuning, self._sessions = pool, tuning, sessions
        self.server = f"{socket.gethostname()}:{os.getpid()}:{secrets.token_hex(3)}"
        self._queued: dict[str, AgentSession | None] = {}  # agent id -> its row to write, None: to delete
        self._others: list[FleetAgent] = []
        self._read_at = float("-inf")

    # -- this server's agents (the reader's side: never waits) -----------------

    def put(self, session: AgentSession) -> None:
        """The agent came, or what placement reads of it changed: (re)write its row."""
        self._queued[session.id] = session
        self.wake()

    def drop(self, session: AgentSession) -> None:
        self._queued[session.id] = None
        self.wake()

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_every(self.tuning.fleet_refresh_seconds, self.refresh,
                                            errors=db.RETRYABLE_ERRORS,
                                            outage=Outage(log, "fleet.refresh_failed")))
            await super().run()

    async def write(self) -> None:
        """Write what was queued; on a failure it stays queued (a newer event for an agent wins)."""
        batch, self._queued = self._queued, {}
        try:
            if rows := [_row(s) for s in batch.values() if s is not None]:
                await self.pool.execute(queries["fleet_put"], self.server, rows)
            if gone := [sid for sid, s in batch.items() if s is None]:
                await self.pool.execute(queries["fleet_drop"], self.server, gone)
        except BaseException:
            for sid, s in batch.items():
                self._queued.setdefault(sid, s)
            raise

    async def refresh(self) -> None:
        """Mark this server's rows seen; write them all again if some are gone; prune the stale."""
        seen = await self.pool.fetchval(queries["fleet_refresh"], self.server)
        sessions = list(self._sessions)
        if seen < len(sessions):
            for s in sessions:  # no await since reading them: a session listed is still connected
                self._queued.setdefault(s.id, s)
            self.wake()
        await self.pool.execute(queries["fleet_prune"], self.tuning.fleet_stale_seconds)

    async def leave(self) -> None:
        """A clean stop: this server's rows go at once, not after the staleness bound."""
        self._queued.clear()
        await self.pool.execute(queries["fleet_drop"], self.server, None)

    # -- the other servers' agents -------------------------------------------

    async def others(self) -> list[FleetAgent]:
        """The agents connected to other servers, seen within the staleness bound; read at most
        every ``fleet_read_seconds`` (in between: the last read)."""
        now = time.monotonic()
        if now - self._read_at >= self.tuning.fleet_read_seconds:
            rows = await self.pool.fetch(queries["fleet_others"], self.server, self.tuning.fleet_stale_seconds)
            self._others = [_agent(r) for r in rows]
            self._read_at = now
        return self._others

    @property
    def last_read(self) -> list[FleetAgent]:
        """The other servers' agents as last read (``others()``), without reading."""
        return self._others


def _row(s: AgentSession) -> dict[str, Any]:
    return {"agent": s.id, "kinds": sorted(s.kinds), "protocol": s.version,
            "devices": [d.memory_mb for d in s.devices], "models": sorted(s.protocol.models),
            "labels": sorted(s.labels), "draining": s.draining}


def _agent(r: Any) -> FleetAgent:
    return FleetAgent(r["agent"], r["server"], frozenset(r["kinds"]), r["protocol"],
                      tuple(Device(i, "", mb) for i, mb in enumerate(r["devices"])),
                      frozenset(r["models"]), frozenset(r["labels"]), r["draining"])
