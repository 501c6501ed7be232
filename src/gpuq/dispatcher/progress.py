"""The progress writer: running jobs' latest progress, stored at most once per job per second.

Agents send the latest update of each job at most twice a second
(``job.progress()``); the server reads them into ``latest`` (what ``/status``
shows) and ``_unwritten``. One task writes everything unwritten with one
``record_progress`` statement, then sleeps ``write_seconds`` (``Tuning``): so each job's row
is written at most once a second, however often its handler reports, and the
statement notifies ``gpuq_progress`` for waiters. An outcome makes a job's
progress moot: ``forget`` drops it, written or not.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpuq import metrics, queue
from gpuq.dispatcher.writer import Writer
from gpuq.protocol import ProgressUpdate


class ProgressWriter(Writer):
    component = "progress"
    failed_event = "progress.write_failed"

    def __init__(self, pool: Any, write_seconds: float):
        super().__init__()
        self.pool = pool
        self.interval = write_seconds  # a job's progress is written at most this often
        self.latest: dict[int, ProgressUpdate] = {}  # running jobs of this server's agents that reported
        self._unwritten: dict[int, ProgressUpdate] = {}

    def submit(self, updates: Iterable[ProgressUpdate]) -> None:
        """Updates of jobs the reporting connection holds (``ServerProtocol`` checked the tokens)."""
        for u in updates:
            self.latest[u.id] = self._unwritten[u.id] = u
        self.wake()

    def forget(self, ids: Iterable[int]) -> None:
        """These jobs ended or left this server: their progress is no longer ours to write."""
        for i in ids:
            if self.latest.pop(i, None) is not None:
                self._unwritten.pop(i, None)

    def of(self, ids: Iterable[int]) -> dict[int, dict[str, Any]]:
        """The latest progress of those of ``ids`` that reported any (for ``/status``)."""
        latest = self.latest
        return {i: {"fraction": u.fraction, "message": u.message} for i in ids if (u := latest.get(i))}

    async def write(self) -> None:
        batch, self._unwritten = self._unwritten, {}
        try:
            written = await queue.record_progress(self.pool, batch.values())
        except BaseException:
            for i, u in batch.items():  # kept for the next try, unless a newer one came or the job ended
                if i in self.latest:
                    self._unwritten.setdefault(i, u)
            raise
        metrics.PROGRESS_WRITTEN.inc(len(written))
