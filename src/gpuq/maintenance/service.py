"""What every maintenance service is: ``run_once()`` on an interval, in bounded batches."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

INTERVAL_SECONDS = 2.0  # how often a service runs, unless told otherwise
BATCH = 1000  # rows per statement
MAX_BATCHES = 10  # statements per run: bounds one run's work


class Service(Protocol):
    name: ClassVar[str]
    interval_seconds: float

    async def run_once(self) -> dict[str, int]: ...


@dataclass
class Batched:
    """A service that repeats one statement of ``batch`` rows, at most ``max_batches`` times a run."""

    db: Any
    interval_seconds: float = INTERVAL_SECONDS
    batch: int = BATCH
    max_batches: int = MAX_BATCHES

    async def batches(self, step: Callable[[Any, int], Awaitable[Any]], size: Callable[[Any], int]) -> list[Any]:
        """``step(db, batch)`` until it handles fewer than ``batch`` rows (``size``) or the run's bound."""
        results = []
        for _ in range(self.max_batches):
            results.append(await step(self.db, self.batch))
            if size(results[-1]) < self.batch:
                break
        return results
