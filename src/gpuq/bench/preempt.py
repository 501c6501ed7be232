"""``gpuq bench preempt``: preemption and spot interruptions, end to end (issue #33).

A ``gpuq serve`` and its agents run in this process (``gpuq.harness``): one
process, one clock. Four parts:

1. **A long job under interruptions.** A synthetic job of ``--steps`` steps
   of ``--step-ms`` (600 of 10 ms: a 10-minute job scaled down), that
   checkpoints every ``--checkpoint-every`` steps (``job.checkpoint``, and
   resumes from ``job.resume_from``, where the agent library has them) and
   folds each step into its output (its agent sends checkpoints at most every half interval).
   Every ``--interrupt-min``..``--interrupt-max``
   seconds the agent running it gets a spot notice (``agent.interrupt(--notice)``)
   and a fresh agent replaces it, ``--interruptions`` times. Figures:
   ``output_equal`` (its result is the uninterrupted run's), ``attempts_used``
   (1: no interruption counts), ``redone_steps_max`` (the steps run again
   after one interruption: at most one checkpoint interval with checkpoints).
2. **Preempt latency.** ``--jobs`` preemptible jobs run at once; each is
   asked to yield with ``gpuq.preempt``; ``preempt_p99_ms`` is from the call
   (it includes its commit and the NOTIFY) to the handler seeing it.
3. **Returned after a notice.** An agent holding ``--prefetch`` jobs ready
   behind a running one gets a notice; ``returned_after_notice_s`` is until
   every ready job is pending again in the database.
4. **Urgent wait.** A 1-GPU agent runs a low-priority preemptible GPU job; a
   priority-10 GPU job is enqueued; the dispatcher preempts the first, which
   yields when asked. ``urgent_wait_p99_s`` (``--urgent`` rounds): from the
   urgent job's enqueue call to its handler's start.

``lost``: jobs not done at the end, or asks that never reached a handler.
Targets: preempt_p99_ms <= 200, returned_after_notice_s <= 1,
redone_steps_max <= one checkpoint interval, output_equal, attempts_used 1,
lost 0, urgent_wait_p99_s <= the grace time + 1 s.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import anyio

import gpuq
from gpuq.agent import JobPreempted, on_preempt
from gpuq.bench import common
from gpuq.bench.measure import percentiles
from gpuq.db import create_pool
from gpuq.harness import running_server
from gpuq.protocol import Device

KIND = "preempt"
MODULUS = 1_000_000_007


def fold(acc: int, step: int) -> int:
    """The synthetic job's output: every step folded in, in order."""
    return (acc * 31 + step + 1) % MODULUS


def uninterrupted(steps: int) -> int:
    acc = 0
    for step in range(steps):
        acc = fold(acc, step)
    return acc


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        common.positive(p, "--steps", 600, "steps of the long job")
        common.positive(p, "--step-ms", 10.0, "each step's time")
        common.positive(p, "--checkpoint-every", 50, "steps between checkpoints")
        common.positive(p, "--interruptions", 4, "spot notices while the long job runs")
        common.positive(p, "--interrupt-min", 0.5, "seconds before each notice, at least")
        common.positive(p, "--interrupt-max", 1.0, "seconds before each notice, at most")
        common.positive(p, "--notice", 5.0, "a notice's seconds")
        common.positive(p, "--jobs", 50, "jobs preempted one at a time (latency)")
        common.positive(p, "--prefetch", 4, "jobs held ready when the notice comes")
        common.positive(p, "--urgent", 5, "urgent jobs, one at a time")
        common.positive(p, "--grace", 5.0, "the preemptible jobs' grace seconds")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        return await run(t.dsn, a)

    common.declare(sub, "preempt", "preemption and spot interruptions: latency, returned work, redone steps, "
                   "urgent wait", __doc__, args, body, report, failures=failures, summary=summary)


async def run(dsn: str, a: argparse.Namespace) -> dict[str, Any]:
    await common.reset_gpuq_schema(dsn)
    result: dict[str, Any] = {"bench": "preempt", "steps": a.steps, "checkpoint_every": a.checkpoint_every,
                              "grace_seconds": a.grace}
    async with await create_pool(dsn, min_size=1, max_size=4) as pool:
        result["postgres"] = await common.server_settings(pool)
        async with running_server(dsn, poll_seconds=1, preempt_min_run_seconds=0) as srv:
            result.update(await long_job(srv, pool, a))
            result.update(await preempt_latency(srv, pool, a))
            result.update(await returned_after_notice(srv, pool, a))
            result.update(await urgent_wait(srv, pool, a))
    result["lost"] = result.pop("long_lost") + result.pop("latency_lost") + result.pop("returned_lost") + result.pop(
        "urgent_lost")
    return result


# -- 1. the long job ---------------------------------------------------------------


class LongJob:
    """The synthetic job's handler, and what it saw: the steps run again after each interruption
    (where the last attempt had got to, less where the next resumed)."""

    def __init__(self, a: argparse.Namespace):
        self.a = a
        self.redone: list[int] = []  # per interruption
        self.reached: int | None = None  # the step the last attempt yielded at
        self.running = anyio.Event()

    async def __call__(self, job: Any) -> dict[str, int]:
        resumed = getattr(job, "resume_from", None) or {}
        step, acc = int(resumed.get("step", 0)), int(resumed.get("acc", 0))
        if self.reached is not None:
            self.redone.append(self.reached - step)
            self.reached = None
        self.running.set()
        while step < self.a.steps:
            if job.preempted:
                self.reached = step
                raise JobPreempted(f"yielded at step {step}")
            await asyncio.sleep(self.a.step_ms / 1000)
            acc, step = fold(acc, step), step + 1
            if step % self.a.checkpoint_every == 0 and hasattr(job, "checkpoint"):
                job.checkpoint({"step": step, "acc": acc})  # not waited for: the agent sends it
        return {"acc": acc}


async def long_job(srv: Any, pool: Any, a: argparse.Namespace) -> dict[str, Any]:
    common.progress(f"long job: {a.steps} steps of {a.step_ms} ms, {a.interruptions} spot notices")
    handler = LongJob(a)
    # Checkpoints go at most every half interval (the agent's own limit is a second by default).
    spot = {"prefetch": 0, "checkpoint_seconds": a.checkpoint_every * a.step_ms / 2000}
    agent = await srv.agent([KIND], 1, handler, "spot-0", **spot)
    job_id = await gpuq.enqueue(pool, KIND, {"long": True}, preemptible=True, grace_seconds=a.grace)
    rng = random.Random(1)
    for i in range(a.interruptions):
        handler.running = anyio.Event()
        with anyio.fail_after(60):
            await handler.running.wait()
        await anyio.sleep(rng.uniform(a.interrupt_min, a.interrupt_max))  # the job runs a while
        if await _status(pool, job_id) != "leased":
            break
        agent.interrupt(a.notice)  # the machine goes away
        agent = await srv.agent([KIND], 1, handler, f"spot-{i + 1}", **spot)  # its replacement
    with anyio.move_on_after(60 + a.steps * a.step_ms / 1000 * 4):
        while await _status(pool, job_id) != "done":
            await anyio.sleep(0.05)
    row = await pool.fetchrow("SELECT status::text AS status, attempts, preemptions, result FROM gpuq.jobs "
                              "WHERE id = $1", job_id)
    done = row["status"] == "done"
    return {"interruptions": row["preemptions"], "attempts_used": row["attempts"],
            "output_equal": done and row["result"] == {"acc": uninterrupted(a.steps)},
            "redone_steps_max": max(handler.redone, default=0), "long_lost": 0 if done else 1}


async def _status(pool: Any, job_id: int) -> str:
    return str(await pool.fetchval("SELECT status::text FROM gpuq.jobs WHERE id = $1", job_id))


# -- 2. preempt latency ---------------------------------------------------------------


async def preempt_latency(srv: Any, pool: Any, a: argparse.Namespace) -> dict[str, Any]:
    common.progress(f"preempt latency: {a.jobs} running jobs asked to yield one at a time")
    seen: dict[int, float] = {}
    asked_events: dict[int, anyio.Event] = {}
    started: set[int] = set()

    async def handle(job: Any) -> None:
        if job.id in seen:
            return  # its second run: done
        asked = asyncio.Event()

        def told() -> None:
            seen.setdefault(job.id, time.perf_counter())
            asked.set()

        on_preempt(job, told)
        started.add(job.id)
        await asked.wait()
        asked_events[job.id].set()
        raise JobPreempted

    kind = f"{KIND}-latency"
    await srv.agent([kind], a.jobs, handle, "latency", prefetch=0)
    ids = await gpuq.enqueue_many(pool, [gpuq.NewJob(kind, {}, preemptible=True, grace_seconds=a.grace)
                                         for _ in range(a.jobs)])
    asked_events.update({i: anyio.Event() for i in ids})
    with anyio.fail_after(60):
        while len(started) < a.jobs:
            await anyio.sleep(0.01)
    latencies, lost = [], 0
    for job_id in ids:
        called = time.perf_counter()  # the call, not its return: serve runs in this loop too
        await gpuq.preempt(pool, job_id)
        with anyio.move_on_after(10):
            await asked_events[job_id].wait()
        if job_id in seen:
            latencies.append((seen[job_id] - called) * 1000)
        else:
            lost += 1
    stats = percentiles(latencies)
    return {"preempt_p50_ms": stats.get("p50_ms"), "preempt_p99_ms": stats.get("p99_ms"),
            "preempt_max_ms": stats.get("max_ms"), "latency_lost": lost}


# -- 3. ready jobs returned after a notice ------------------------------------------------


async def returned_after_notice(srv: Any, pool: Any, a: argparse.Namespace) -> dict[str, Any]:
    common.progress(f"returned after a notice: {a.prefetch} jobs held ready behind a running one")
    kind = f"{KIND}-ready"
    running = anyio.Event()

    async def handle(job: Any) -> None:
        if job.grace_seconds is None:
            return  # a ready one (it never starts before the notice)
        running.set()
        asked = asyncio.Event()
        on_preempt(job, asked.set)
        await asked.wait()
        raise JobPreempted

    agent = await srv.agent([kind], 1, handle, "ready", prefetch=a.prefetch)
    first = await gpuq.enqueue(pool, kind, {}, preemptible=True, grace_seconds=a.grace)
    with anyio.fail_after(30):
        await running.wait()
    ready = await gpuq.enqueue_many(pool, [gpuq.NewJob(kind, {}) for _ in range(a.prefetch)])
    with anyio.fail_after(30):  # held ready by the agent itself, not only leased
        while len(agent.protocol.waiting) < len(ready):
            await anyio.sleep(0.005)
    noticed = time.monotonic()
    agent.interrupt(a.notice)
    with anyio.move_on_after(a.notice):
        while await _count(pool, ready, "pending") < len(ready):
            await anyio.sleep(0.005)
    returned_s = time.monotonic() - noticed
    back = await _count(pool, ready, "pending")
    with anyio.move_on_after(a.notice):
        while await _count(pool, [first], "pending") < 1:
            await anyio.sleep(0.01)
    lost = len(ready) - back + 1 - await _count(pool, [first], "pending")
    await pool.execute("DELETE FROM gpuq.jobs WHERE kind = $1", kind)  # no agent takes them now
    return {"returned_after_notice_s": round(returned_s, 3), "returned_jobs": back, "returned_lost": lost}


async def _count(pool: Any, ids: list[int], status: str) -> int:
    return int(await pool.fetchval("SELECT count(*) FROM gpuq.jobs WHERE id = ANY($1) AND status::text = $2",
                                   ids, status))


# -- 4. the urgent job's wait ---------------------------------------------------------------


async def urgent_wait(srv: Any, pool: Any, a: argparse.Namespace) -> dict[str, Any]:
    common.progress(f"urgent wait: {a.urgent} priority-10 GPU jobs, each behind a preemptible one")
    kind = f"{KIND}-gpu"
    started = anyio.Event()
    urgent_started: dict[int, float] = {}

    async def handle(job: Any) -> str:
        if job.payload.get("urgent"):
            urgent_started[job.id] = time.perf_counter()
            return "urgent"
        started.set()
        asked = asyncio.Event()
        on_preempt(job, asked.set)
        await asked.wait()
        raise JobPreempted

    await srv.agent([kind], 1, handle, "gpu", devices=[Device(0, "bench", 81920)])
    waits, lost = [], 0
    for _ in range(a.urgent):
        started = anyio.Event()
        low = await gpuq.enqueue(pool, kind, {}, gpus=1, preemptible=True, grace_seconds=a.grace)
        with anyio.fail_after(30):
            await started.wait()
        called = time.perf_counter()  # the enqueue call; its handler's start is the wait's end
        urgent = await gpuq.enqueue(pool, kind, {"urgent": True}, gpus=1, priority=10)
        with anyio.move_on_after(a.grace + 30):
            while await _status(pool, urgent) != "done":
                await anyio.sleep(0.01)
        if urgent in urgent_started:
            waits.append((urgent_started[urgent] - called) * 1000)
        else:
            lost += 1
        await gpuq.cancel(pool, low)  # back to pending, then running again: the next round starts afresh
        await pool.execute("DELETE FROM gpuq.jobs WHERE id = $1", low)
    stats = percentiles(waits)
    p99 = stats.get("p99_ms")
    return {"urgent_wait_p50_s": None if not stats else round(stats["p50_ms"] / 1000, 3),
            "urgent_wait_p99_s": None if p99 is None else round(p99 / 1000, 3), "urgent_lost": lost}


# -- output ---------------------------------------------------------------------------


def failures(r: dict[str, Any]) -> list[str]:
    bad = [f"{r['lost']} jobs or asks lost"] if r["lost"] else []
    if not r["output_equal"]:
        bad.append("the interrupted job's output differs from an uninterrupted run's")
    if r["attempts_used"] != 1:
        bad.append(f"the interrupted job used {r['attempts_used']} attempts")
    return bad


def report(r: dict[str, Any]) -> None:
    common.print_settings(r["postgres"])
    common.print_pairs("preempt", [
        ("long job: steps, checkpoint every", f"{r['steps']}, {r['checkpoint_every']}"),
        ("interruptions (preemptions counted)", r["interruptions"]),
        ("output equal to an uninterrupted run", r["output_equal"]),
        ("attempts used", r["attempts_used"]),
        ("redone steps, most after one interruption", r["redone_steps_max"]),
        ("preempt call -> handler sees it, p50 / p99 / max ms",
         f"{r['preempt_p50_ms']} / {r['preempt_p99_ms']} / {r['preempt_max_ms']}"),
        ("ready jobs back after a notice (s)", f"{r['returned_after_notice_s']} ({r['returned_jobs']} jobs)"),
        ("urgent job's wait p50 / p99 (s)", f"{r['urgent_wait_p50_s']} / {r['urgent_wait_p99_s']}"),
        ("grace seconds", r["grace_seconds"]),
        ("lost", r["lost"])])
    print("targets: preempt_p99_ms <= 200, returned_after_notice_s <= 1, redone_steps_max <= checkpoint interval, "
          "output_equal, attempts_used 1, lost 0, urgent_wait_p99_s <= grace + 1")


def summary(r: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in r.items() if k != "postgres"}


if __name__ == "__main__":
    raise SystemExit(common.standalone("preempt"))
