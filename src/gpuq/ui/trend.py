"""The overview's last hour, kept in the server's memory: never computed from history.

Every ``sample_seconds`` the dashboard takes one ``Sample``: jobs done,
attempts failed and jobs dead per second (this dispatcher's committed
outcomes, from its counters), the queue depth (the live counts of the
census's last read, ``gpuq.census``: the dashboard reads no counts of its
own for them) and the lease and completion latency of the interval
(``gpuq.latency``). A ring holds an hour of them; ``chart``
draws a series as SVG points.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from gpuq import metrics
from gpuq.jobs import StatusCounts
from gpuq.latency import JobLatency

HOUR_SECONDS = 3600.0


@dataclass(frozen=True, slots=True)
class Sample:
    at: float  # wall clock, seconds
    done_per_s: float
    failed_per_s: float  # failed attempts: retried or dead
    dead_per_s: float  # jobs that died (out of attempts, or not retryable)
    pending: int
    leased: int
    scheduled: int
    lease_p50_ms: float | None
    lease_p99_ms: float | None
    completion_p50_ms: float | None
    completion_p99_ms: float | None


def _total(counter: Any, **only: str) -> float:
    """A labelled counter's sum over its label sets (those matching ``only``)."""
    return sum(s.value for m in counter.collect() for s in m.samples
               if s.name.endswith("_total") and all(s.labels.get(k) == v for k, v in only.items()))


class Trend:
    """An hour of samples, one every ``sample_seconds``."""

    def __init__(self, latency: JobLatency, sample_seconds: float, clock: Any = time.time):
        self.latency = latency
        self.sample_seconds = sample_seconds
        self.clock = clock
        self.samples: deque[Sample] = deque(maxlen=max(2, int(HOUR_SECONDS / sample_seconds)))
        self._last = self._counts()

    def _counts(self) -> tuple[float, float, float, float]:
        return (self.clock(), _total(metrics.JOBS_DONE), _total(metrics.JOBS_FAILED),
                _total(metrics.JOBS_FAILED, outcome="dead"))

    def take(self, counts: StatusCounts) -> Sample:
        """One sample: rates since the last one, depth now, latency of the interval."""
        (then, done0, failed0, dead0), (now, done1, failed1, dead1) = self._last, self._counts()
        self._last = (now, done1, failed1, dead1)
        span = max(now - then, 1e-6)
        lease, completion = self.latency.take()
        sample = Sample(now, (done1 - done0) / span, (failed1 - failed0) / span, (dead1 - dead0) / span,
                        counts.total("pending"),
                        counts.total("leased"), counts.total("scheduled"), lease.p50_ms, lease.p99_ms,
                        completion.p50_ms, completion.p99_ms)
        self.samples.append(sample)
        return sample

    def charts(self) -> dict[str, Any]:
        """What the overview draws: per group, its top value, and per series its SVG points and
        its latest value (the last sample that had one). The samples held span the width."""
        s = list(self.samples)
        series: dict[str, list[float | None]] = {
            "done": [x.done_per_s for x in s], "failed": [x.failed_per_s for x in s],
            "dead": [x.dead_per_s for x in s],
            "pending": [float(x.pending) for x in s], "leased": [float(x.leased) for x in s],
            "lease_p50": [x.lease_p50_ms for x in s], "completion_p50": [x.completion_p50_ms for x in s],
            "lease_p99": [x.lease_p99_ms for x in s], "completion_p99": [x.completion_p99_ms for x in s],
        }
        groups: dict[str, tuple[str, ...]] = {"throughput": ("done", "failed"), "depth": ("pending", "leased"),
                                              "latency": ("lease_p50", "completion_p50")}
        out: dict[str, Any] = {"samples": len(s), "sample_seconds": self.sample_seconds,
                               "span_seconds": s[-1].at - s[0].at if len(s) > 1 else 0.0}
        for group, names in groups.items():
            top = max((v for n in names for v in series[n] if v is not None), default=0.0) or 1.0
            out[group] = {"top": top, **{n: chart(series[n], top, len(s)) for n in names}}
        out["last"] = {n: next((v for v in reversed(values) if v is not None), None) for n, values in series.items()}
        return out


WIDTH, HEIGHT = 360, 60


def chart(values: list[float | None], top: float, slots: int) -> str:
    """SVG polyline points for ``values`` on a WIDTH x HEIGHT box, the newest at the right edge
    (``slots`` samples span the width; a missing value breaks nothing, it is skipped)."""
    step = WIDTH / max(slots - 1, 1)
    start = WIDTH - step * (len(values) - 1)
    return " ".join(f"{start + i * step:.1f},{HEIGHT - HEIGHT * v / top:.1f}"
                    for i, v in enumerate(values) if v is not None)
