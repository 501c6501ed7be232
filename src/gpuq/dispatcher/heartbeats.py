"""Heartbeats: agents' running jobs get their leases extended, in the background.

The server's reader only queues a heartbeat (``submit``). Each agent's
heartbeats are written by a task of their own, one statement at a time, so a
heartbeat held up by a locked row holds up only its own agent, as when the
reader awaited it, and never the next frame. A job whose lease is gone
(cancelled, or reclaimed) is cancelled on that agent: this reaches it even
when no notification can (poll-only behind a pooler). A heartbeat of an agent
that has left is dropped: its jobs may already run elsewhere. If the database
is away the heartbeat is dropped with a warning: the next one extends the lease.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio

from gpuq import db, logs, queue

log = logs.get("heartbeats")


class Heartbeats:
    def __init__(self, pool: Any, lease_seconds: float, on_lost: Callable[[str, list[int]], None]):
        self.pool = pool
        self.lease_seconds = lease_seconds
        self.on_lost = on_lost  # (agent, job ids) whose lease is gone: stop their handlers on that agent
        self._queued: dict[str, set[int]] = {}  # agent (the jobs' leased_by) -> job ids
        self._writing: set[str] = set()  # agents whose task is writing
        self._wake = anyio.Event()

    def submit(self, agent: str, ids: Sequence[int]) -> None:
        self._queued.setdefault(agent, set()).update(ids)
        self._wake.set()

    def forget(self, agent: str) -> None:
        """The agent left: a heartbeat of its not yet written must not touch its jobs' next leases."""
        self._queued.pop(agent, None)

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            while True:
                await self._wake.wait()
                self._wake = anyio.Event()
                for agent in [a for a in self._queued if a not in self._writing]:
                    self._writing.add(agent)
                    tg.start_soon(self._write_for, agent)

    async def _write_for(self, agent: str) -> None:
        """Write the agent's heartbeats until none is queued."""
        try:
            while (ids := self._queued.pop(agent, None)) is not None:
                await self._extend(agent, ids)
        finally:
            self._writing.discard(agent)

    async def _extend(self, agent: str, ids: set[int]) -> None:
        try:
            extended = await queue.heartbeat(self.pool, sorted(ids), agent, self.lease_seconds)
        except db.RETRYABLE_ERRORS as exc:
            log.warning("heartbeat.failed", agent=agent, error=str(exc))
            return
        if lost := sorted(ids - extended):
            self.on_lost(agent, lost)
