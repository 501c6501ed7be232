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

from gpuq import queue
from gpuq.dispatcher.writer import Writer


class Heartbeats(Writer):
    component = "heartbeats"
    failed_event = "heartbeat.failed"
    retry_failed = False  # the next heartbeat extends the lease

    def __init__(self, pool: Any, lease_seconds: float, on_lost: Callable[[list[int]], None]):
        super().__init__()
        self.pool = pool
        self.lease_seconds = lease_seconds
        self.on_lost = on_lost  # jobs whose lease is gone: stop their handlers
        self._queued: dict[str, set[int]] = {}  # agent (the jobs' leased_by) -> job ids

    def submit(self, agent: str, ids: Sequence[int]) -> None:
        self._queued.setdefault(agent, set()).update(ids)
        self.wake()

    async def write(self) -> None:
        """Extend every queued lease; tell ``on_lost`` of those that are gone."""
        batch, self._queued = self._queued, {}
        for agent, ids in batch.items():
            extended = await queue.heartbeat(self.pool, sorted(ids), agent, self.lease_seconds)
            if lost := sorted(ids - extended):
                self.on_lost(lost)
