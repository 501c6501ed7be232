"""A demo handler that stands in for GPU work (used by ``gpuq dev`` and the deploy examples).

The job's payload may set ``seconds`` (how long the "GPU" works) and
``fail`` (raise, to show retries); otherwise ``GPUQ_DEMO_SECONDS`` (0.05).
"""

from __future__ import annotations

from typing import Any

import anyio

from gpuq import config
from gpuq.agent import Job


async def handle(job: Job) -> dict[str, Any]:
    payload = job.payload if isinstance(job.payload, dict) else {}
    seconds = float(payload.get("seconds", config.get("demo_seconds")))
    await anyio.sleep(seconds)
    if payload.get("fail"):
        raise RuntimeError("demo failure requested by the payload")
    return {"ok": True, "job": job.id, "attempt": job.attempt, "seconds": seconds}


async def noop(job: Job) -> None:
    """Does nothing: for benchmarks of the queue itself."""
    return None
