"""How busy an agent's slots are (protocol 6): handler time, and the idle gaps while work waited.

A *gap* is the time a slot (or a device) spent idle between one job's end
and the next job's start **while that next job was already waiting**: it
counts from the later of the slot freeing and the job becoming runnable
(``queued_ms`` before the push, told by the server with each job). A slot
idle because the queue was empty has no gap. The agent counts with
``SlotClock`` and reports what it counted since its last report in each
heartbeat (``SlotReport``); the server adds the gaps to a histogram on
``/metrics`` and the busy fraction of the last minute to ``/status``
(``BusyWindow``).

busy fraction = handler time / (handler time + gaps)
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from gpuq.protocol.codes import ErrorCode, ProtocolError

__all__ = ["GAP_BUCKETS_MS", "BusyWindow", "SlotClock", "SlotReport", "busy_fraction", "slots_from", "slots_json"]

# Upper bounds of the gap histogram's buckets, in ms (the last bucket: longer).
GAP_BUCKETS_MS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0, 250.0, 1000.0)
MAX_REPORT_MS = 1e12  # 30 years of handler time in one report: more is a bug, not a fleet
BUSY_WINDOW_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class SlotReport:
    """Since the agent's last report: handler time, gap time, gap counts per ``GAP_BUCKETS_MS``."""

    busy_ms: float
    idle_ms: float
    gaps: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return not (self.busy_ms or self.idle_ms or any(self.gaps))


def slots_from(value: Any) -> SlotReport:
    """``heartbeat.slots``: ``{busy_ms, idle_ms, gaps}``, gaps one count per bucket."""
    rule = (f"heartbeat.slots must be an object {{busy_ms, idle_ms, gaps}}: two numbers from 0 to "
            f"{MAX_REPORT_MS:.0e} and {len(GAP_BUCKETS_MS) + 1} counts")
    if not isinstance(value, dict) or value.keys() != {"busy_ms", "idle_ms", "gaps"}:
        raise ProtocolError(ErrorCode.BAD_MESSAGE, rule)
    busy, idle, gaps = value["busy_ms"], value["idle_ms"], value["gaps"]
    if (not _number_in(busy) or not _number_in(idle) or not isinstance(gaps, list)
            or len(gaps) != len(GAP_BUCKETS_MS) + 1
            or not all(type(n) is int and 0 <= n <= 2**31 for n in gaps)):
        raise ProtocolError(ErrorCode.BAD_MESSAGE, rule)
    return SlotReport(float(busy), float(idle), tuple(gaps))


def slots_json(r: SlotReport) -> dict[str, Any]:
    return {"busy_ms": round(r.busy_ms, 3), "idle_ms": round(r.idle_ms, 3), "gaps": list(r.gaps)}


def _number_in(value: Any) -> bool:
    return type(value) in (int, float) and 0 <= value <= MAX_REPORT_MS


class SlotClock:
    """The agent's count (sans I/O: every call says ``now``, seconds on one monotonic clock).

    Slots without devices are anonymous: a job takes the slot free the
    longest. A job with devices takes the latest-freed of its devices' times.
    """

    def __init__(self, capacity: int, devices: Iterable[int], now: float):
        self._free_slots: deque[float] = deque([now] * capacity)  # when each free slot freed
        self._device_free: dict[int, float] = dict.fromkeys(devices, now)
        # job id -> [when it fell due, when the slot it will run in freed, when its handler started]
        self._jobs: dict[int, list[float]] = {}
        self._busy = self._idle = 0.0
        self._gaps = [0] * (len(GAP_BUCKETS_MS) + 1)

    def pushed(self, job_id: int, queued_ms: float | None, now: float) -> None:
        self._jobs[job_id] = [now - (queued_ms or 0) / 1000, now, now]

    def assigned(self, job_id: int, devices: tuple[int, ...], now: float, freed: float | None = None) -> None:
        """``job_id`` will run in a free slot (``freed``: the slot its job before just left), or on
        ``devices``, free now."""
        if (job := self._jobs.get(job_id)) is None:
            return
        if freed is None:
            if devices:
                freed = max((self._device_free.get(d, now) for d in devices), default=now)
            else:
                freed = self._free_slots.popleft() if self._free_slots else now
        job[1] = freed

    def started(self, job_id: int, now: float) -> None:
        if (job := self._jobs.get(job_id)) is not None:
            job[2] = now

    def ended(self, job_id: int, devices: tuple[int, ...], now: float, start: float | None = None) -> None:
        """``job_id``'s handler returned ``now``; ``start``: when it began, if the I/O layer timed it
        (a sync handler, in its thread), else when it was ``started()``. Its gap is counted now."""
        for d in devices:
            self._device_free[d] = now
        if (job := self._jobs.pop(job_id, None)) is None:
            return
        runnable, freed, began = job
        if start is not None:
            began = start
        gap = began - (freed if freed > runnable else runnable)
        if gap > 0:
            self._idle += gap
            self._gaps[bisect.bisect_left(GAP_BUCKETS_MS, gap * 1000)] += 1
        else:
            self._gaps[0] += 1
        self._busy += now - began

    def slot_freed(self, now: float) -> None:
        """A slot without devices has no next job: it waits from now."""
        self._free_slots.append(now)

    def forget(self, job_id: int) -> None:
        """A job that never ran here (released, cancelled while ready, or lost)."""
        self._jobs.pop(job_id, None)

    def report(self) -> SlotReport:
        """What was counted since the last report, and start counting afresh."""
        out = SlotReport(self._busy * 1000, self._idle * 1000, tuple(self._gaps))
        self._busy = self._idle = 0.0
        self._gaps = [0] * len(self._gaps)
        return out


class BusyWindow:
    """The server's sum of one agent's reports over the last ``BUSY_WINDOW_SECONDS``."""

    def __init__(self) -> None:
        self._reports: deque[tuple[float, float, float]] = deque()  # (at, busy_ms, idle_ms)

    def add(self, report: SlotReport, now: float) -> None:
        self._reports.append((now, report.busy_ms, report.idle_ms))
        self._trim(now)

    def totals(self, now: float) -> tuple[float, float]:
        """(busy_ms, idle_ms) reported in the window."""
        self._trim(now)
        return sum(r[1] for r in self._reports), sum(r[2] for r in self._reports)

    def _trim(self, now: float) -> None:
        while self._reports and self._reports[0][0] < now - BUSY_WINDOW_SECONDS:
            self._reports.popleft()


def busy_fraction(busy_ms: float, idle_ms: float) -> float | None:
    """Handler time over handler time plus gaps (None: nothing ran)."""
    total = busy_ms + idle_ms
    return round(busy_ms / total, 4) if total > 0 else None
