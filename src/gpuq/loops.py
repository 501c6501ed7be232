"""``run_every``: the one loop for long-running work that must survive failures.

Every service loop of gpuq (LISTEN, leasing, the completer, maintenance, the
agent's connection) is a ``step`` called forever: after a success it waits
``interval``; after one of ``errors`` it waits a doubling, jittered delay
(``LoopBackoff``) so an outage is retried, logged, and never fatal.
Nothing here knows the database: the caller names its retryable errors.
"""

from __future__ import annotations

import random
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


async def run_every(
    interval: float,
    step: Callable[[], Awaitable[Any]],
    *,
    backoff: LoopBackoff = LoopBackoff(),
    errors: tuple[type[BaseException], ...] = (),
    on_error: Callable[[BaseException, float], None] | None = None,
    until: Callable[[], bool] | None = None,
    wake: Any = None,
) -> None:
    """Call ``step`` until ``until()`` is true (forever without it).

    ``on_error(exc, retry_in)`` hears each failure among ``errors`` (others
    propagate). ``wake``, an event, cuts any wait short.
    """
    delays = backoff.delays()
    while until is None or not until():
        try:
            await step()
        except errors as exc:
            wait = next(delays)
            if on_error is not None:
                on_error(exc, round(wait, 3))
        else:
            wait, delays = interval, backoff.delays()
        if wait > 0 and (until is None or not until()):
            with anyio.move_on_after(wait):
                if wake is None:
                    await anyio.sleep_forever()
                await wake.wait()
