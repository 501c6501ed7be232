"""Agent handlers of the benches (``--handler gpuq.bench.handlers:NAME``); no-op is ``gpuq.demo:noop``."""

from __future__ import annotations

import hashlib
import json
import os
import random
import tempfile
import time
from typing import Any

import anyio

from gpuq.agent import Job, JobPreempted, on_preempt

EXEC_DIR_ENV = "GPUQ_CHAOS_DIR"  # where record() writes, one file per agent process
WORK_MS_ENV = "GPUQ_CHAOS_WORK_MS"  # mean simulated work per job of record()


async def latency(job: Job) -> dict[str, Any]:
    """Report (handler start - the producer's insert time) in ms, as the job's result."""
    start = time.time()
    sent = job.payload.get("t") if isinstance(job.payload, dict) else None
    return {"lat_ms": (start - float(sent)) * 1000 if sent is not None else None}


async def batch_sleep(jobs: list[Job]) -> list[Any]:
    """``gpuq bench batching``'s batch handler: a forward pass's cost, the first job's ``fixed_ms``
    plus its ``per_item_ms`` per item (none given: returns at once); an item whose payload says
    ``poison`` gets an exception, for itself alone."""
    first = jobs[0].payload
    fixed, per_item = first.get("fixed_ms"), first.get("per_item_ms", 0.0)
    if fixed is not None:
        await anyio.sleep((fixed + per_item * len(jobs)) / 1000)
    return [ValueError("poison") if j.payload.get("poison") else None for j in jobs]


async def work(job: Job) -> dict[str, Any]:
    """Soak: a couple of milliseconds of 'GPU time'."""
    await anyio.sleep(0.002)
    return {"id": job.id}


async def progress(job: Job) -> None:
    """No-op that reports progress twice: the agent's side of progress on the hot path (a job that
    ends before the agent's next send drops its updates; the server's side is not reached)."""
    job.progress(0.5, "half")
    job.progress(1.0, "done", {"id": job.id})


_exec_fd: int | None = None


def _exec_log() -> int:
    """This process's execution log (``$GPUQ_CHAOS_DIR/exec-PID.log``), opened for appending once."""
    global _exec_fd
    if _exec_fd is None:
        directory = os.environ.get(EXEC_DIR_ENV) or tempfile.gettempdir()
        _exec_fd = os.open(os.path.join(directory, f"exec-{os.getpid()}.log"),
                           os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    return _exec_fd


async def record(job: Job) -> dict[str, Any]:
    """Chaos: log this execution (one O_APPEND write survives a SIGKILL), work a little,
    return the lease token it ran with."""
    os.write(_exec_log(), f"{job.id} {job.lease_token} {os.getpid()}\n".encode())
    work_s = float(os.environ.get(WORK_MS_ENV, "0") or 0) / 1000.0
    if work_s > 0:
        await anyio.sleep(random.uniform(0, 2 * work_s))
    return {"token": job.lease_token}


async def record_yielding(job: Job) -> dict[str, Any]:
    """Chaos with preemption: ``record``, and a job asked to yield during its work stops at once
    (``JobPreempted``: it goes back to pending and runs again, maybe elsewhere)."""
    os.write(_exec_log(), f"{job.id} {job.lease_token} {os.getpid()}\n".encode())
    work_s = float(os.environ.get(WORK_MS_ENV, "0") or 0) / 1000.0
    asked = anyio.Event()
    on_preempt(job, asked.set)
    with anyio.move_on_after(random.uniform(0, 2 * work_s)):
        await asked.wait()
    if asked.is_set():
        raise JobPreempted("asked to yield")
    return {"token": job.lease_token}


async def record_batch(jobs: list[Job]) -> list[dict[str, Any]]:
    """Chaos with batching: ``record`` for a batch, its executions in one write, one work time."""
    os.write(_exec_log(), "".join(f"{j.id} {j.lease_token} {os.getpid()}\n" for j in jobs).encode())
    work_s = float(os.environ.get(WORK_MS_ENV, "0") or 0) / 1000.0
    if work_s > 0:
        await anyio.sleep(random.uniform(0, 2 * work_s))
    return [{"token": j.lease_token} for j in jobs]


async def timed(job: Job) -> dict[str, float]:
    """Sleep ``payload["sleep"]`` seconds (default 0.05); the result is when it ran (wall clock), for
    counting how many ran at once across agent processes."""
    start = time.time()
    await anyio.sleep(float(job.payload.get("sleep", 0.05)) if isinstance(job.payload, dict) else 0.05)
    return {"start": start, "end": time.time()}


def _sleep_seconds(job: Job) -> float:
    return float(job.payload.get("sleep", 0.02)) if isinstance(job.payload, dict) else 0.02


async def busy_async(job: Job) -> dict[str, float]:
    """``gpuq bench busy``: sleep ``payload["sleep"]`` (default 20 ms); the result is when the handler
    ran (wall clock, this process) and the process, for the gaps between one job and the next."""
    start = time.time()
    await anyio.sleep(_sleep_seconds(job))
    return {"start": start, "end": time.time(), "pid": os.getpid()}


def busy_sync(job: Job) -> dict[str, float]:
    """``busy_async`` as a plain function (the agent runs it in a thread)."""
    start = time.time()
    time.sleep(_sleep_seconds(job))
    return {"start": start, "end": time.time(), "pid": os.getpid()}


def failover_answer(payload: Any) -> dict[str, Any]:
    """``gpuq bench failover``: the one right result of a payload (the verdict checks every done job against it)."""
    digest = hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]
    return {"n": payload.get("n") if isinstance(payload, dict) else None, "digest": digest}


async def failover(job: Job) -> dict[str, Any]:
    """``gpuq bench failover``: log this execution as ``id n pid`` (one O_APPEND write, like ``record``),
    sleep ``payload["sleep"]`` seconds, return ``failover_answer(payload)``."""
    payload = job.payload if isinstance(job.payload, dict) else {}
    os.write(_exec_log(), f"{job.id} {payload.get('n')} {os.getpid()}\n".encode())
    await anyio.sleep(float(payload.get("sleep", 0)))
    return failover_answer(job.payload)
