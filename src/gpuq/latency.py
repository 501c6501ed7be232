"""How long jobs wait: lease latency (due -> leased) and completion latency (due -> outcome committed).

The dispatcher tells ``JobLatency`` what it leased (each job says how long it
had been due, ``queued_ms``) and the completer what it committed; the
dashboard takes the figures of each interval (``take``). Per job this is a
dict entry and two reservoir adds; memory stays bounded whether or not anyone
takes them. The figures are those of this dispatcher.
"""

from __future__ import annotations

import random
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# At most this many jobs are followed between two takes: a lost entry (a job
# released, reclaimed, or beyond the cap) only loses its sample.
FOLLOWED = 100_000
# At most this many figures are kept per interval (a uniform sample of them
# beyond it), so memory stays bounded when nobody takes them (no dashboard).
KEPT = 10_000


@dataclass(frozen=True, slots=True)
class Percentiles:
    n: int
    p50_ms: float | None
    p99_ms: float | None


def percentiles(values: list[float], n: int | None = None) -> Percentiles:
    """p50 and p99 of ``values`` (a sample of ``n`` figures; default: all of them)."""
    if not values:
        return Percentiles(0, None, None)
    ordered = sorted(values)
    return Percentiles(len(ordered) if n is None else n, ordered[len(ordered) // 2],
                       ordered[min(len(ordered) - 1, len(ordered) * 99 // 100)])


class Reservoir:
    """A uniform sample of at most ``KEPT`` of the values added (Algorithm R)."""

    def __init__(self) -> None:
        self.values: list[float] = []
        self.seen = 0

    def add(self, value: float) -> None:
        self.seen += 1
        if len(self.values) < KEPT:
            self.values.append(value)
        elif (i := random.randrange(self.seen)) < KEPT:
            self.values[i] = value


class JobLatency:
    def __init__(self, clock: Any = time.monotonic):
        self.clock = clock
        self._due: dict[int, float] = {}  # job id -> when it became due (clock seconds)
        self._lease_ms = Reservoir()
        self._completion_ms = Reservoir()

    def leased(self, jobs: Iterable[Any]) -> None:
        """Jobs just leased (``id``, ``queued_ms``)."""
        now = self.clock()
        if len(self._due) > FOLLOWED:
            self._due.clear()
        for j in jobs:
            if j.queued_ms is not None:
                self._due[j.id] = now - j.queued_ms / 1000
                self._lease_ms.add(j.queued_ms)

    def finished(self, done: Iterable[int], other: Iterable[int] = ()) -> None:
        """Outcomes committed: ``done`` completed (sampled), ``other`` failed (forgotten)."""
        now = self.clock()
        for job_id in done:
            due = self._due.pop(job_id, None)
            if due is not None:
                self._completion_ms.add((now - due) * 1000)
        for job_id in other:
            self._due.pop(job_id, None)

    def take(self) -> tuple[Percentiles, Percentiles]:
        """Lease and completion latency since the last take."""
        lease, completion = self._lease_ms, self._completion_ms
        self._lease_ms, self._completion_ms = Reservoir(), Reservoir()
        return percentiles(lease.values, lease.seen), percentiles(completion.values, completion.seen)
