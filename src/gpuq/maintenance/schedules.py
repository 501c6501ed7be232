"""Due periodic jobs (``gpuq schedule add``) are enqueued, once per tick across every sweeper."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from gpuq import logs, schedules
from gpuq.maintenance.service import INTERVAL_SECONDS

log = logs.get("sweeper")


@dataclass
class FireSchedules:
    name: ClassVar[str] = "fire_schedules"
    db: Any
    interval_seconds: float = INTERVAL_SECONDS

    async def run_once(self) -> dict[str, int]:
        fired = await schedules.fire_due(self.db)
        if fired:
            log.info("sweeper.schedules_fired", count=fired)
        return {"schedules_fired": fired}
