"""Heartbeats: agents' running jobs get their leases extended, in the background.

The server's reader only queues a heartbeat (``submit``); one task extends the
leases of everything queued by then, one statement per agent. A job whose lease
is gone (cancelled, or reclaimed) is cancelled on the agent too: this reaches it
even when no notification can (poll-only behind a pooler). If the database is
away the heartbeat is dropped with a warning: the next one extends the lease.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import anyio

from gpuq import db, logs, queue
from gpuq.loops import run_every

log = logs.get("heartbeats")


class Heartbeats:
    def __init__(self, pool: Any, lease_seconds: float, on_lost: Callable[[list[int]], None]):
        self.pool = pool
        self.lease_seconds = lease_seconds
        self.on_lost = on_lost  # jobs whose lease is gone: stop their handlers
        self._queued: dict[str, set[int]] = {}  # agent (the jobs' leased_by) -> job ids
        self._wake = anyio.Event()

    def submit(self, agent: str, ids: Sequence[int]) -> None:
        self._queued.setdefault(agent, set()).update(ids)
        self._wake.set()

    async def run(self) -> None:
        await run_every(0, self._extend_when_woken, errors=db.RETRYABLE_ERRORS, on_error=self._failed)

    async def _extend_when_woken(self) -> None:
        await self._wake.wait()
        self._wake = anyio.Event()
        await self.extend()

    async def extend(self) -> None:
        """Extend every queued lease; tell ``on_lost`` of those that are gone."""
        batch, self._queued = self._queued, {}
        for agent, ids in batch.items():
            extended = await queue.heartbeat(self.pool, sorted(ids), agent, self.lease_seconds)
            if lost := sorted(ids - extended):
                self.on_lost(lost)

    def _failed(self, exc: BaseException, _retry_in: float) -> None:
        log.warning("heartbeat.failed", error=str(exc))
