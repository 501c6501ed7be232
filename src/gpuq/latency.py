"""How long jobs wait: lease latency (due -> leased) and completion latency (due -> outcome committed).

The dispatcher tells ``JobLatency`` what it leased (each job says how long it
had been due, ``queued_ms``) and the completer what it committed; the
dashboard takes the figures of each interval (``take``) and turns it on; off,
it costs one test per batch. On, the work is per batch (list building, set
operations in C) with a dict entry for one job in FOLLOW_EVERY, and memory
stays bounded. The figures are those of this dispatcher.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

# At most this many jobs are followed between two takes: a lost entry (a job
# released, reclaimed, or beyond the cap) only loses its sample.
FOLLOWED = 100_000
# About this many figures are kept per interval (an even sample of them beyond
# it), so memory and the percentile sort stay bounded however many jobs run.
KEPT = 10_000
# One job in this many of a leased batch is followed to its completion (all,
# at batches of one, as when agents wait idle).
FOLLOW_EVERY = 4


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


class Sample:
    """Every ``stride``-th value added, the stride doubling whenever 2 x KEPT are held: an even
    sample over the interval, at most 2 x KEPT values, and no Python work per value (slices)."""

    def __init__(self) -> None:
        self.values: list[float] = []  # values[i] is the (i x stride)-th value added
        self.seen = 0
        self.stride = 1

    def add(self, values: list[float]) -> None:
        start, self.seen = self.seen, self.seen + len(values)
        self.values.extend(values[len(self.values) * self.stride - start::self.stride])
        if len(self.values) >= 2 * KEPT:
            del self.values[1::2]
            self.stride *= 2


class JobLatency:
    """Off until the dashboard turns it on (``enabled``): then a few list and dict operations per batch."""

    def __init__(self, clock: Any = time.monotonic, enabled: bool = True):
        self.clock = clock
        self.enabled = enabled
        self._due: dict[int, float] = {}  # job id -> when it became due (clock seconds)
        self._lease_ms = Sample()
        self._completion_ms = Sample()

    def leased(self, jobs: Sequence[Any]) -> None:
        """Jobs just leased (``id``, ``queued_ms``): every wait counts; one job in FOLLOW_EVERY of a
        batch (every job of a batch of one) is followed to its completion."""
        if not self.enabled:
            return
        now = self.clock()
        self._lease_ms.add([j.queued_ms for j in jobs if j.queued_ms is not None])
        if len(self._due) > FOLLOWED:
            self._due.clear()
        for j in jobs[::FOLLOW_EVERY]:
            if j.queued_ms is not None:
                self._due[j.id] = now - j.queued_ms / 1000

    def finished(self, done: AbstractSet[int], other: Iterable[int] = ()) -> None:
        """Outcomes committed: ``done`` completed (sampled), ``other`` failed (forgotten)."""
        if not self._due:
            return
        now, due = self.clock(), self._due
        self._completion_ms.add([(now - due.pop(i)) * 1000 for i in due.keys() & done])
        for i in due.keys() & set(other):
            del due[i]

    def take(self) -> tuple[Percentiles, Percentiles]:
        """Lease and completion latency since the last take."""
        lease, completion = self._lease_ms, self._completion_ms
        self._lease_ms, self._completion_ms = Sample(), Sample()
        return percentiles(lease.values, lease.seen), percentiles(completion.values, completion.seen)
