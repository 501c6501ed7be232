"""Retention: delete done/dead rows older than it, walking the primary key in fixed windows.

It starts from the oldest id and stops at the first window that holds rows
younger than the retention (ids grow with time: the rest is younger still),
so each statement examines at most ``window`` ids whatever the table size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gpuq import logs, metrics, queue
from gpuq.maintenance.service import INTERVAL_SECONDS, MAX_BATCHES

log = logs.get("sweeper")

WINDOW = 5000  # ids examined per statement


@dataclass
class PruneHistory:
    db: Any
    retention_seconds: float
    interval_seconds: float = INTERVAL_SECONDS
    window: int = WINDOW
    max_batches: int = MAX_BATCHES
    name: ClassVar[str] = "prune_history"
    _cursor: int | None = None  # next id to examine; None = start from the oldest

    async def run_once(self) -> dict[str, int]:
        deleted = 0
        for _ in range(self.max_batches):
            if self._cursor is None:
                self._cursor = await queue.min_job_id(self.db)
                if self._cursor is None:
                    break  # empty table
            n, reached_young, max_id = await queue.prune_window(
                self.db, self._cursor, self.window, self.retention_seconds)
            deleted += n
            self._cursor += self.window
            if reached_young or max_id is None or self._cursor > max_id:
                # The rest is younger than the retention: start over next run
                # (rows skipped while live get their turn once they finish).
                self._cursor = None
                break
        metrics.SWEEP_PRUNED.inc(deleted)
        if deleted:
            log.info("sweeper.pruned", count=deleted)
        return {"pruned": deleted}
