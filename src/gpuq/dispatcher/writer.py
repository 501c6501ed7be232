"""The shape every background writer of the dispatcher shares: one task, woken by what is submitted.

A part queues what the server's reader hands it and calls ``wake()``; ``run()``
writes everything queued by then with ``write()``, at most every ``interval``
seconds, and retries with backoff while the database is away, never failing.
"""

from __future__ import annotations

import anyio

from gpuq import db, logs
from gpuq.loops import Outage, run_every


class Writer:
    component = "dispatcher"  # what its log lines say they come from
    interval = 0.0  # the least time between two writes
    failed_event = "write_failed"  # the warning logged when a write fails
    retry_failed = True  # write again after a failure (what failed is still queued)

    def __init__(self) -> None:
        self._wake = anyio.Event()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        await run_every(self.interval, self._write_when_woken, errors=db.RETRYABLE_ERRORS, on_error=self._failed,
                        outage=Outage(logs.get(self.component), self.failed_event))

    async def _write_when_woken(self) -> None:
        await self._wake.wait()
        self._wake = anyio.Event()
        await self.write()

    async def write(self) -> None:
        raise NotImplementedError

    def _failed(self, exc: BaseException, retry_in: float) -> None:
        if self.retry_failed:
            self._wake.set()
