"""Demo handlers that stand in for GPU work (used by ``gpuq dev`` and the deploy examples).

``handle`` reads the job's payload:

- ``seconds``: how long the "GPU" works (else ``GPUQ_DEMO_SECONDS``, 0.05);
- ``steps``: work in that many steps over those seconds, reporting progress
  as each begins ("step 3/20" and a made-up loss), as a training job would;
- ``fail``: raise (true, or the error's text), to show retries and dead jobs;
- ``fail_attempts``: raise only on attempts up to this one, so a retry succeeds.

``handle_batch`` runs a batch in one call (one "forward pass": the longest
``seconds`` of its items plus a millisecond per item); an item whose payload
sets ``fail`` fails alone.
"""

from __future__ import annotations

from typing import Any

import anyio

from gpuq import config
from gpuq.agent import Job

BATCH_ITEM_SECONDS = 0.001  # what each item adds to a batch's one pass


async def handle(job: Job) -> dict[str, Any]:
    payload = _payload(job)
    seconds = _seconds(payload)
    steps = int(payload.get("steps", 0))
    if steps > 0:
        await _work_in_steps(job, seconds, steps)
    else:
        await anyio.sleep(seconds)
    if _fails(job, payload):
        raise RuntimeError(_failure(payload))
    return {"ok": True, "job": job.id, "attempt": job.attempt, "seconds": seconds}


async def handle_batch(jobs: list[Job]) -> list[Any]:
    """One pass for the whole batch; one entry per job, in order: a result, or that job's error."""
    payloads = [_payload(job) for job in jobs]
    await anyio.sleep(max(_seconds(p) for p in payloads) + BATCH_ITEM_SECONDS * len(jobs))
    return [RuntimeError(_failure(p)) if _fails(job, p) else {"ok": True, "job": job.id, "batch_size": len(jobs)}
            for job, p in zip(jobs, payloads, strict=True)]


async def noop(job: Job) -> None:
    """Does nothing: for benchmarks of the queue itself."""
    return None


def _payload(job: Job) -> dict[str, Any]:
    return job.payload if isinstance(job.payload, dict) else {}


def _seconds(payload: dict[str, Any]) -> float:
    return float(payload.get("seconds", config.get("demo_seconds")))


async def _work_in_steps(job: Job, seconds: float, steps: int) -> None:
    """Each step says it has begun, then works: a progress bar shows from the job's first moment."""
    for step in range(steps):
        job.progress(step / steps, f"step {step + 1}/{steps}", {"loss": round(2.5 / (1 + 0.3 * step), 3)})
        await anyio.sleep(seconds / steps)


def _fails(job: Job, payload: dict[str, Any]) -> bool:
    """Whether this attempt fails: every attempt for ``fail``, up to ``fail_attempts`` when that is set."""
    if "fail_attempts" in payload:
        return job.attempt <= int(payload["fail_attempts"])
    return bool(payload.get("fail"))


def _failure(payload: dict[str, Any]) -> str:
    fail = payload.get("fail")
    return fail if isinstance(fail, str) else "demo failure requested by the payload"
