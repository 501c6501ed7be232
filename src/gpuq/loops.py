"""``run_every``: the one loop for long-running work that must survive failures.

Every service loop of gpuq (LISTEN, leasing, the completer, maintenance, the
agent's connection) is a ``step`` called forever: after a success it waits
``interval``; after one of ``errors`` it waits a doubling, jittered delay
(``LoopBackoff``) so an outage is retried, logged once (``Outage``), and
never fatal. Nothing here knows the database: the caller names its retryable
errors.
"""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import anyio


@dataclass(frozen=True)
class LoopBackoff:
    """A service loop's delays after consecutive failed steps: ``first``, doubling up to ``cap``,
    each times a random factor in [1 - jitter, 1] so that many clients do not retry in step.
    (A failed job's delay before its next attempt is ``gpuq.jobs.JobBackoff``, computed in SQL.)"""

    first: float = 0.05
    cap: float = 5.0
    jitter: float = 0.5

    def delays(self) -> Iterator[float]:
        """The delays after the first, second, ... failure in a row (a fresh one after a success)."""
        delay = self.first
        while True:
            yield delay * random.uniform(1 - self.jitter, 1)
            delay = min(delay * 2, self.cap)


class Outage:
    """A loop's failures in a row, logged once per episode: ``event`` (a warning) when they begin,
    ``<topic>.recovered`` (info: how long, how many) at the next success. The failures between
    go to debug, and at most one warning each ``remind_seconds`` says the outage goes on."""

    def __init__(self, logger: Any, event: str, remind_seconds: float = 60.0, **fields: Any):
        self.log, self.event, self.remind_seconds, self.fields = logger, event, remind_seconds, fields
        self.recovered_event = f"{event.split('.')[0]}.recovered"
        self.since: float | None = None  # monotonic time of the episode's first failure
        self.failures = 0
        self._reminded_at = 0.0

    def failed(self, exc: BaseException, retry_in: float) -> None:
        now = time.monotonic()
        error = str(exc) or type(exc).__name__
        self.failures += 1
        if self.since is None:
            self.since = self._reminded_at = now
            self.log.warning(self.event, error=error, retry_in=retry_in, **self.fields)
        elif now - self._reminded_at >= self.remind_seconds:
            self._reminded_at = now
            self.log.warning(self.event, error=error, retry_in=retry_in, failures=self.failures,
                             seconds=round(now - self.since, 1), **self.fields)
        else:
            self.log.debug(self.event, error=error, retry_in=retry_in, failures=self.failures, **self.fields)

    def ended(self) -> None:
        """A step succeeded: an episode, if one was going on, is over."""
        if self.since is not None:
            self.log.info(self.recovered_event, failed=self.event, failures=self.failures,
                          seconds=round(time.monotonic() - self.since, 3), **self.fields)
            self.since, self.failures = None, 0


async def run_every(
    interval: float,
    step: Callable[[], Awaitable[Any]],
    *,
    backoff: LoopBackoff = LoopBackoff(),
    errors: tuple[type[BaseException], ...] = (),
    on_error: Callable[[BaseException, float], None] | None = None,
    outage: Outage | None = None,
    until: Callable[[], bool] | None = None,
    wake: Any = None,
) -> None:
    """Call ``step`` until ``until()`` is true (forever without it).

    ``on_error(exc, retry_in)`` hears each failure among ``errors`` (others
    propagate); ``outage`` logs them once per episode. ``wake``, an event,
    cuts any wait short.
    """
    delays = backoff.delays()
    while until is None or not until():
        try:
            await step()
        except errors as exc:
            if outage is not None and outage.since is None:
                delays = backoff.delays()  # a new outage (one ended in the step) backs off afresh
            wait = next(delays)
            if outage is not None:
                outage.failed(exc, round(wait, 3))
            if on_error is not None:
                on_error(exc, round(wait, 3))
        else:
            wait, delays = interval, backoff.delays()
            if outage is not None and outage.since is not None:
                outage.ended()
        if wait > 0 and (until is None or not until()):
            with anyio.move_on_after(wait):
                if wake is None:
                    await anyio.sleep_forever()
                await wake.wait()
