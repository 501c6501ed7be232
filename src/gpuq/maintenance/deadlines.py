"""Attempts past their execution timeout fail, even while their agent heartbeats.

Heartbeats mean "the agent is alive", not "the job is fine": an agent that
keeps heartbeating a hung handler would hold the job for ever. The agent
stops a handler at its deadline itself; this backs it up, ``grace_seconds``
later, with error ``timeout`` and the retry policy of any failure, and tells
the agent to stop the handler (a ``cancel``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from gpuq import logs, queue
from gpuq.maintenance.service import Batched

log = logs.get("sweeper")

GRACE_SECONDS = 30.0  # after the deadline, before the server fails the attempt


@dataclass
class ExpireDeadlines(Batched):
    name: ClassVar[str] = "expire_deadlines"
    grace_seconds: float = GRACE_SECONDS

    async def run_once(self) -> dict[str, int]:
        moved = await self.batches(lambda db, n: queue.expire_deadlines(db, n, self.grace_seconds),
                                   lambda m: len(m.pending) + len(m.dead))
        retried = [i for m in moved for i in m.pending]
        dead = [i for m in moved for i in m.dead]
        if retried or dead:
            log.info("job.timed_out", retried=retried[:100], dead=dead[:100], grace_seconds=self.grace_seconds)
        return {"timed_out": len(retried) + len(dead)}
