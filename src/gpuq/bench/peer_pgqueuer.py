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


def version() -> str:
    return str(getattr(_require(), "__version__", "?"))


async def install(dsn: str) -> None:
    """Drop any pgqueuer schema objects and install them afresh (+ its autovacuum settings)."""
    _require()
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(dsn)
    try:
        q = Queries(AsyncpgDriver(conn))
        if await q.schema_is_installed():
            await q.uninstall()
        await q.install()
        await q.optimize_autovacuum()
    finally:
        await conn.close()


async def enqueue_bulk(dsn: str, n: int, chunk: int = ENQUEUE_CHUNK) -> float:
    """Insert n jobs for the no-op entrypoint; return the seconds it took."""
    _require()
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(dsn)
    try:
        q = Queries(AsyncpgDriver(conn))
        t0 = time.perf_counter()
        for lo in range(0, n, chunk):
            k = min(chunk, n - lo)
            await q.enqueue([ENTRYPOINT] * k, [None] * k, [0] * k)
        return time.perf_counter() - t0
    finally:
        await conn.close()


async def queued(dsn: str) -> int:
    """Jobs still in pgqueuer's queue table (any status)."""
    _require()
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(dsn)
    try:
        stats = await Queries(AsyncpgDriver(conn)).queue_size()
        return sum(s.count for s in stats)
    finally:
        await conn.close()


# --------------------------------------------------------------------------
# Throughput: drain a pre-filled queue
# --------------------------------------------------------------------------


def _run_loop(coro: Any, use_uvloop: bool) -> Any:
    if use_uvloop:
        with contextlib.suppress(ImportError):
            import uvloop

            return uvloop.run(coro)
    return asyncio.run(coro)


async def _drain(dsn: str, workers: int, batch_size: int, ready: Any, go: Any) -> int:
    from pgqueuer import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.domain.types import QueueExecutionMode
    from pgqueuer.models import Job
    from pgqueuer.queries import Queries

    handled = 0
    qms = []
    for _ in range(workers):
        conn = await asyncpg.connect(dsn)
        qm = QueueManager(Queries(AsyncpgDriver(conn)))

        @qm.entrypoint(ENTRYPOINT)
        async def noop(job: Job) -> None:
            nonlocal handled
            handled += 1

        qms.append((qm, conn))
    ready.set()
    await asyncio.get_running_loop().run_in_executor(None, go.wait)
    try:
        await asyncio.gather(*(qm.run(batch_size=batch_size, mode=QueueExecutionMode.drain)
                               for qm, _ in qms))
    finally:
        for _, conn in qms:
            await conn.close()
    return handled


def _drain_process(dsn: str, workers: int, batch_size: int, use_uvloop: bool,
                   ready: Any, go: Any, out: Any) -> None:
    _quiet_pgqueuer_logs()
    out.put(_run_loop(_drain(dsn, workers, batch_size, ready, go), use_uvloop))


def consume(dsn: str, n: int, *, batch_size: int = DEFAULT_BATCH, workers: int = DEFAULT_WORKERS,
            processes: int = 1, use_uvloop: bool = True, timeout: float = 600.0) -> tuple[float, float]:
    """Drain n queued jobs with ``processes`` x ``workers`` QueueManagers; (seconds, jobs/s).

    The clock starts once every process has connected, and stops when the
    last one has drained the queue and flushed its completion log.
    """
    _require()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    go = ctx.Event()
    readies = [ctx.Event() for _ in range(processes)]
    procs = [ctx.Process(target=_drain_process,
                         args=(dsn, workers, batch_size, use_uvloop, r, go, out), daemon=True)
             for r in readies]
    for p in procs:
        p.start()
    try:
        for r in readies:
            if not r.wait(60):
                raise RuntimeError("pgqueuer consumer process did not start")
        t0 = time.perf_counter()
        go.set()
        handled = sum(out.get(timeout=timeout) for _ in procs)
        elapsed = time.perf_counter() - t0
        for p in procs:
            p.join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
    if handled != n:
        raise RuntimeError(f"pgqueuer handled {handled} jobs, expected {n}")
    return elapsed, n / elapsed


async def throughput(dsn: str, n: int, **kwargs: Any) -> dict[str, Any]:
    """Install, bulk-enqueue n jobs, drain them; figures as a dict."""
    await install(dsn)
    insert_s = await enqueue_bulk(dsn, n)
    elapsed, rate = await asyncio.to_thread(consume, dsn, n, **kwargs)
    left = await queued(dsn)
    if left:
        raise RuntimeError(f"pgqueuer left {left} jobs in its queue")
    return {"jobs": n, "insert_s": round(insert_s, 3), "consume_s": round(elapsed, 3),
            "end_to_end_s": round(insert_s + elapsed, 3),
            "jobs_per_s": round(rate, 1), "end_to_end_jobs_per_s": round(n / (insert_s + elapsed), 1)}


# --------------------------------------------------------------------------
# Latency: an idle consumer, jobs inserted one at a time at a fixed rate
# --------------------------------------------------------------------------


async def _listen(dsn: str, expected: int, batch_size: int, ready: Any, out: Any) -> None:
    from pgqueuer import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.models import Job
    from pgqueuer.queries import Queries

    conn = await asyncpg.connect(dsn)
    qm = QueueManager(Queries(AsyncpgDriver(conn)))
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
    _require()
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

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
            q = Queries(AsyncpgDriver(conn))
            await q.enqueue(ENTRYPOINT, WARMUP)
            if not await asyncio.to_thread(ready.wait, 60):
                raise RuntimeError("pgqueuer latency consumer did not start")
            await asyncio.sleep(0.2)
            t0 = time.perf_counter()
            for i in range(n):
                delay = t0 + i / rate - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
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


def percentiles(values_ms: list[float]) -> dict[str, float]:
    xs = sorted(values_ms)
    if not xs:
        return {}

    def pct(p: float) -> float:
        return round(xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))], 3)

    return {"p50_ms": pct(50), "p90_ms": pct(90), "p99_ms": pct(99), "max_ms": round(xs[-1], 3)}


def _quiet_pgqueuer_logs() -> None:
    import logging

    logging.getLogger("pgqueuer").setLevel(logging.WARNING)


# --------------------------------------------------------------------------
# End to end: consumers idle and listening, then the producer inserts
# --------------------------------------------------------------------------

# Completion is a DELETE from pgqueuer + an INSERT into pgqueuer_log
# ('successful') in one statement, so an empty queue table means every result
# is committed. created = now() of the inserting/completing transaction.
_QUEUE_EMPTY = "SELECT NOT EXISTS (SELECT 1 FROM pgqueuer)"
_E2E = """
SELECT extract(epoch FROM max(created) FILTER (WHERE status = 'successful')
                         - min(created) FILTER (WHERE status = 'queued'))::float8 AS seconds,
       count(*) FILTER (WHERE status = 'successful') AS done
FROM pgqueuer_log
"""


async def _serve_until(dsn: str, workers: int, batch_size: int, ready: Any, stop: Any) -> None:
    from pgqueuer import QueueManager
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.models import Job
    from pgqueuer.queries import Queries

    qms, conns = [], []
    for _ in range(workers):
        conn = await asyncpg.connect(dsn)
        qm = QueueManager(Queries(AsyncpgDriver(conn)))

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
                     cpu_of: Any = None, pg_pid: int | None = None,
                     timeout: float = 900.0) -> dict[str, Any]:
    """Consumers first (idle, listening), then n jobs inserted ``chunk`` at a time.

    Returns end-to-end seconds (first insert -> last result committed, from the
    database's own timestamps), jobs/s, and the CPU seconds of the consumers
    (and of the PostgreSQL server ``pg_pid``, with its backends) when
    ``cpu_of(pids)`` is given.
    """
    _require()
    from pgqueuer.db import AsyncpgDriver
    from pgqueuer.queries import Queries

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
        cpu0 = cpu_of([p.pid for p in procs]) if cpu_of else 0.0
        pg0 = cpu_of([pg_pid]) if cpu_of and pg_pid else None
        q = Queries(AsyncpgDriver(conn))
        for lo in range(0, n, chunk):
            k = min(chunk, n - lo)
            await q.enqueue([ENTRYPOINT] * k, [None] * k, [0] * k)
        deadline = time.monotonic() + timeout
        while not await conn.fetchval(_QUEUE_EMPTY):
            if time.monotonic() > deadline:
                raise RuntimeError("pgqueuer did not finish in time")
            await asyncio.sleep(0.05)
        cpu1 = cpu_of([p.pid for p in procs]) if cpu_of else 0.0
        pg1 = cpu_of([pg_pid]) if cpu_of and pg_pid else None
        row = await conn.fetchrow(_E2E)
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
            "consumer_cpu_s": round(cpu1 - cpu0, 2),
            "postgres_cpu_s": round(pg1 - pg0, 2) if pg0 is not None and pg1 is not None else None,
            "batch_size": batch_size, "workers": workers,
            "processes": processes, "chunk": chunk}
