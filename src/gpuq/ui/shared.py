"""Reads that many dashboard clients share: one database read per key and period, however many look.

Each open page asks for its fragment every second; without sharing, twenty
operators would run twenty overview reads a second. ``Shared.get(key, read)``
returns the value read for ``key`` recently, or, when none is, runs
``read()`` once for every caller waiting on it. "Recently" is ``ttl``
seconds, or longer when the read was slow: a read that took d seconds is kept
for d / LOAD_SHARE, so the dashboard's reads of a key take at most that share
of the database's time, however big the backlog makes them.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Hashable
from typing import Any, TypeVar

T = TypeVar("T")

# Keys are page + filters; more than this many at once (a crawler) start over.
MAX_KEYS = 256
LOAD_SHARE = 0.02


class Shared:
    def __init__(self, ttl: float, clock: Callable[[], float] = time.monotonic):
        self.ttl = ttl
        self.clock = clock
        self._entries: dict[Hashable, tuple[float, asyncio.Future[Any]]] = {}
        self._took: dict[Hashable, float] = {}  # how long each key's last read took

    async def get(self, key: Hashable, read: Callable[[], Awaitable[T]]) -> T:
        now = self.clock()
        entry = self._entries.get(key)
        if entry is None or now - entry[0] >= self.keep(key) or _failed(entry[1]):
            if len(self._entries) >= MAX_KEYS:
                self.clear()
            future: asyncio.Future[T] = asyncio.ensure_future(self._timed(key, read))
            entry = self._entries[key] = (now, future)
        return await asyncio.shield(entry[1])  # a caller that goes away does not cancel the others' read

    def keep(self, key: Hashable) -> float:
        """How long a value read for ``key`` is shared."""
        return max(self.ttl, self._took.get(key, 0.0) / LOAD_SHARE)

    async def _timed(self, key: Hashable, read: Callable[[], Awaitable[T]]) -> T:
        start = self.clock()
        value = await read()
        self._took[key] = self.clock() - start
        return value

    def clear(self) -> None:
        self._entries.clear()
        self._took.clear()


def _failed(future: asyncio.Future[Any]) -> bool:
    """A failed read is not shared: the next caller reads again."""
    return future.done() and (future.cancelled() or future.exception() is not None)
