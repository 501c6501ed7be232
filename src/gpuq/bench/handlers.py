"""Agent handlers for the benches (``--handler gpuq.bench.handlers:NAME``)."""

from __future__ import annotations

import time
from typing import Any

from gpuq.agent import Job


async def noop(job: Job) -> None:
    """Does nothing: throughput of the queue itself."""
    return None


async def latency(job: Job) -> dict[str, Any]:
    """Report (handler start - the producer's insert time) in ms, as the job's result."""
    start = time.time()
    sent = job.payload.get("t") if isinstance(job.payload, dict) else None
    return {"lat_ms": (start - float(sent)) * 1000 if sent is not None else None}
