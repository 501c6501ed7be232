"""pgqueuer, the peer we measure gpuq against, run at its own best documented settings.

pgqueuer (PyPI ``pgqueuer``, the ``bench`` extra) documents its throughput
method in ``tools/benchmark.py`` / docs "Benchmarks": the asyncpg driver
(about twice psycopg), several dequeue workers each a ``QueueManager`` on its
own connection (its benchmark default: 5), a dequeue ``batch_size`` of 10
(raise it for short jobs, docs "Performance Tuning"), the ``drain`` strategy
for a pre-filled queue, and uvloop. Its checklist also says to run ``pgq
autovac`` after installing (``Queries.optimize_autovacuum``), which we do.
Durability stays at its default, ``durable`` (logged tables), like gpuq's.

Functions here:

- ``install(dsn)``: (re)install pgqueuer's schema (tables ``pgqueuer``,
  ``pgqueuer_log``, ``pgqueuer_statistics``, ...) in the DSN's search path;
- ``enqueue_bulk(dsn, n)``: insert n no-op jobs in large batches;
- ``consume(dsn, n, ...)``: worker processes drain the queue with a no-op
  entrypoint; returns (elapsed seconds, jobs/s);
- ``latency(dsn, rate, seconds)``: an idle consumer process; the producer
  inserts one job at a time at ``rate``/s; each job carries its insert time
  and the handler records (handler start - insert time).

Timing across processes uses ``time.time()`` (same machine, same clock).
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import queue as stdlib_queue
import time
from datetime import timedelta
from typing import Any

import asyncpg

from gpuq.bench.common import queries
from gpuq.bench.measure import CpuMeter, percentiles

ENTRYPOINT = "noop"
ENQUEUE_CHUNK = 10_000
WARMUP = b"warmup"

# pgqueuer's documented benchmark settings (tools/benchmark.py defaults).
DEFAULT_WORKERS = 5
DEFAULT_BATCH = 10


def _require() -> Any:
    try:
        import pgqueuer
    except ImportError:
        raise RuntimeError("pgqueuer is not installed: pip install 'gpuq[bench]'") from None
    return pgqueuer


def _queries(conn: Any) -> Any:
    """pgqueuer's query layer on an asyncpg connection."""
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    return Queries(AsyncpgDriver(conn))


def _manager(conn: Any) -> Any:
    """A pgqueuer QueueManager on an asyncpg connection."""
    from pgqueuer import QueueManager

    return QueueManager(_queries(conn))


def version() -> str:
    return str(getattr(_require(), "__version__", "?"))


async def install(dsn: str) -> None:
    """Drop any pgqueuer schema objects and install them afresh (+ its autovacuum settings)."""
    _require()
    conn = await asyncpg.connect(dsn)
    try:
        q = _queries(conn)
        if await q.schema_is_installed():
            await q.uninstall()
        await q.install()
        await q.optimize_autovacuum()
    finally:
        await conn.close()


def _run_loop(coro: Any, use_uvloop: bool) -> Any:
    if use_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            return uvloop.run(coro)
    return asyncio.run(coro)


# --------------------------------------------------------------------------
# Latency: an idle consumer, jobs inserted one at a time at a fixed rate
# --------------------------------------------------------------------------


async def _listen(dsn: str, expected: int, batch_size: int, ready: Any, out: Any) -> None:
    from pgqueuer.models import Job

    conn = await asyncpg.connect(dsn)
    qm = _manager(conn)
    lat: list[float] = []

    @qm.entrypoint(ENTRYPOINT)
    async def record(job: Job) -> None:
        start = time.time()
        if job.payload == WARMUP:  # the consumer is up and listening
            ready.set()
            return
        lat.append((start - float(job.payload or b"0")) * 1000)
        if len(lat) >= expected:
            qm.shutdown.set()

    try:
        await qm.run(batch_size=batch_size, dequeue_timeout=timedelta(seconds=30))
    finally:
        await conn.close()
    out.put(lat)


def _listen_process(dsn: str, expected: int, batch_size: int, use_uvloop: bool,
                    ready: Any, out: Any) -> None:
    _quiet_pgqueuer_logs()
    _run_loop(_listen(dsn, expected, batch_size, ready, out), use_uvloop)


async def latency(dsn: str, rate: float, seconds: float, *, batch_size: int = DEFAULT_BATCH,
                  use_uvloop: bool = True) -> dict[str, Any]:
    """Insert ``rate`` jobs/s for ``seconds`` into an idle consumer; latency percentiles (ms)."""
    await install(dsn)
    n = max(1, round(rate * seconds))
    ctx = mp.get_context("spawn")
    out, ready = ctx.Queue(), ctx.Event()
    proc = ctx.Process(target=_listen_process, args=(dsn, n, batch_size, use_uvloop, ready, out),
                       daemon=True)
    proc.start()
    try:
        conn = await asyncpg.connect(dsn)
        try:
            q = _queries(conn)
            await q.enqueue(ENTRYPOINT, WARMUP)
            if not await asyncio.to_thread(ready.wait, 60):
                raise RuntimeError("pgqueuer latency consumer did not start")
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            for i in range(n):
                await asyncio.sleep(max(0.0, t0 + i / rate - time.perf_counter()))
                await q.enqueue(ENTRYPOINT, repr(time.time()).encode())
        finally:
            await conn.close()
        lat = await asyncio.to_thread(out.get, True, seconds + 60)
    except stdlib_queue.Empty:
        raise RuntimeError("pgqueuer latency consumer did not report") from None
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.terminate()
    return {"jobs": n, "rate": rate, **percentiles(lat)}



def _quiet_pgqueuer_logs() -> None:
    import logging

    logging.getLogger("pgqueuer").setLevel(logging.WARNING)


# --------------------------------------------------------------------------
# End to end: consumers idle and listening, then the producer inserts
# --------------------------------------------------------------------------

# Completion is a DELETE from pgqueuer + an INSERT into pgqueuer_log
# ('successful') in one statement, so an empty queue table means every
# result is committed.
async def _serve_until(dsn: str, workers: int, batch_size: int, ready: Any, stop: Any) -> None:
    from pgqueuer.models import Job

    qms, conns = [], []
    for _ in range(workers):
        conn = await asyncpg.connect(dsn)
        qm = _manager(conn)

        @qm.entrypoint(ENTRYPOINT)
        async def noop(job: Job) -> None:
            return None

        qms.append(qm)
        conns.append(conn)
    loop = asyncio.get_running_loop()

    async def stopper() -> None:
        await loop.run_in_executor(None, stop.wait)
        for qm in qms:
            qm.shutdown.set()

    async def signal_ready() -> None:
        await asyncio.sleep(1.0)  # run() has checked the schema and is LISTENing by now
        ready.set()

    tasks = [asyncio.create_task(stopper()), asyncio.create_task(signal_ready())]
    try:
        await asyncio.gather(*(qm.run(batch_size=batch_size, dequeue_timeout=timedelta(seconds=5))
                               for qm in qms))
    finally:
        for t in tasks:
            t.cancel()
        for conn in conns:
            await conn.close()


def _serve_process(dsn: str, workers: int, batch_size: int, use_uvloop: bool,
                   ready: Any, stop: Any) -> None:
    _quiet_pgqueuer_logs()
    _run_loop(_serve_until(dsn, workers, batch_size, ready, stop), use_uvloop)


async def end_to_end(dsn: str, n: int, *, chunk: int = ENQUEUE_CHUNK, batch_size: int = DEFAULT_BATCH,
                     workers: int = DEFAULT_WORKERS, processes: int = 1, use_uvloop: bool = True,
                     pg_pid: int | None = None, timeout: float = 900.0) -> dict[str, Any]:
    """Consumers first (idle, listening), then n jobs inserted ``chunk`` at a time.

    Returns end-to-end seconds (first insert -> last result committed, from the
    database's own timestamps), jobs/s, and the CPU seconds of the consumers
    (and of the PostgreSQL server ``pg_pid``, with its backends).
    """
    _require()

    await install(dsn)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    readies = [ctx.Event() for _ in range(processes)]
    procs = [ctx.Process(target=_serve_process,
                         args=(dsn, workers, batch_size, use_uvloop, r, stop), daemon=True)
             for r in readies]
    for p in procs:
        p.start()
    conn = await asyncpg.connect(dsn)
    try:
        for r in readies:
            if not await asyncio.to_thread(r.wait, 60):
                raise RuntimeError("pgqueuer consumer process did not start")
        cpu = CpuMeter({"consumers": [p.pid for p in procs if p.pid], "postgres": [pg_pid] if pg_pid else []})
        cpu.start()
        q = _queries(conn)
        for lo in range(0, n, chunk):
            k = min(chunk, n - lo)
            await q.enqueue([ENTRYPOINT] * k, [None] * k, [0] * k)
        deadline = time.monotonic() + timeout
        while not await conn.fetchval(queries["pgqueuer_empty"]):
            if time.monotonic() > deadline:
                raise RuntimeError("pgqueuer did not finish in time")
            await asyncio.sleep(0.05)
        used = cpu.stop()
        row = await conn.fetchrow(queries["pgqueuer_end_to_end"])
    finally:
        stop.set()
        await conn.close()
        for p in procs:
            await asyncio.to_thread(p.join, 15)
            if p.is_alive():
                p.terminate()
    if row["done"] != n:
        raise RuntimeError(f"pgqueuer completed {row['done']} jobs, expected {n}")
    seconds = float(row["seconds"])
    return {"jobs": n, "seconds": round(seconds, 3), "jobs_per_s": round(n / seconds, 1),
            "consumer_cpu_s": used["consumers"], "postgres_cpu_s": used["postgres"],
            "batch_size": batch_size, "workers": workers,
            "processes": processes, "chunk": chunk}
