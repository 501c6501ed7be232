"""How long jobs wait: lease latency (due -> leased) and completion latency (due -> outcome committed).

The dispatcher tells ``JobLatency`` what it leased (each job says how long it
had been due, ``queued_ms``) and the completer what it committed; the
dashboard takes the figures of each interval (``take``). Per job this is a
dict entry and two list appends; the figures are those of this dispatcher.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# At most this many jobs are followed between two takes: a lost entry (a job
# released, reclaimed, or beyond the cap) only loses its sample.
FOLLOWED = 100_000


@dataclass(frozen=True, slots=True)
class Percentiles:
    n: int
    p50_ms: float | None
    p99_ms: float | None


def percentiles(values: list[float]) -> Percentiles:
    if not values:
        return Percentiles(0, None, None)
    ordered = sorted(values)
    return Percentiles(len(ordered), ordered[len(ordered) // 2], ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)])


class JobLatency:
    def __init__(self, clock: Any = time.monotonic):
        self.clock = clock
        self._due: dict[int, float] = {}  # job id -> when it became due (clock seconds)
        self._lease_ms: list[float] = []
        self._completion_ms: list[float] = []

    def leased(self, jobs: Iterable[Any]) -> None:
        """Jobs just leased (``id``, ``queued_ms``)."""
        now = self.clock()
        if len(self._due) > FOLLOWED:
            self._due.clear()
        for j in jobs:
            if j.queued_ms is not None:
                self._due[j.id] = now - j.queued_ms / 1000
                self._lease_ms.append(j.queued_ms)

    def finished(self, done: Iterable[int], other: Iterable[int] = ()) -> None:
        """Outcomes committed: ``done`` completed (sampled), ``other`` failed (forgotten)."""
        now = self.clock()
        for job_id in done:
            due = self._due.pop(job_id, None)
            if due is not None:
                self._completion_ms.append((now - due) * 1000)
        for job_id in other:
            self._due.pop(job_id, None)

    def take(self) -> tuple[Percentiles, Percentiles]:
        """Lease and completion latency since the last take."""
        lease, completion = self._lease_ms, self._completion_ms
        self._lease_ms, self._completion_ms = [], []
        return percentiles(lease), percentiles(completion)
