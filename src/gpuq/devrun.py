"""``gpuq dev``: the whole system on an embedded PostgreSQL, with live progress.

Starts (or reuses) the private cluster under ``.gpuq/``, migrates, runs the
server (dispatcher + sweeper + websockets), the demo's simulated GPU agents
and its producer (``gpuq.demomix``) in one process, and prints one progress
line per second until Ctrl-C or ``--duration``. Then it drains, stops the
cluster (its data is kept) and exits 0.
"""

from __future__ import annotations

import argparse
import secrets
import sys
import time
from pathlib import Path

import anyio

from gpuq import admin, demomix, devdb, logs, metrics
from gpuq.agent import Agent
from gpuq.config import ServerConfig
from gpuq.db import create_pool
from gpuq.demomix import Mix, Producer
from gpuq.migrate import migrate
from gpuq.runtime import run_service
from gpuq.server import serve
from gpuq.signals import stop_on_signal

# A stop (Ctrl-C, --duration) waits this long for the running jobs; the long demo jobs that still
# run are given back to the queue (and run again next time).
DRAIN_SECONDS = 0.5
# The overview's charts get a point every 2 s (not 10 s): a shape in the first minute.
UI_SAMPLE_SECONDS = 2.0


def run_dev(args: argparse.Namespace) -> int:
    if args.log_level is None:
        logs.configure(args.log_format, "warning", stream=sys.stderr)  # keep the progress readable
    cluster = devdb.dev_cluster(Path(args.data_dir))
    print(f"starting PostgreSQL from {cluster.bindir} (data in {cluster.data_dir}) ...", flush=True)
    dsn = cluster.ensure_started()
    print(f"PostgreSQL ready at {dsn}", flush=True)
    try:
        run_service(_run, args, dsn)
    finally:
        cluster.stop()
        print("PostgreSQL stopped (data kept for the next run)", flush=True)
    return 0


async def _run(args: argparse.Namespace, dsn: str) -> None:
    applied = await migrate(dsn)
    print(f"migrations: {', '.join(applied) if applied else 'up to date'}", flush=True)
    token, ui_token = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    config = ServerConfig(database_url=dsn, listen=("127.0.0.1", args.port), tokens=frozenset({token}),
                          ui_admin_tokens=frozenset({ui_token}), lease_seconds=30, heartbeat_seconds=5,
                          poll_seconds=1, drain_seconds=DRAIN_SECONDS,
                          ui_sample_seconds=UI_SAMPLE_SECONDS)
    stop = anyio.Event()
    port_ready = anyio.Event()
    ports: list[int] = []

    def on_ready(port: int) -> None:
        ports.append(port)
        port_ready.set()

    pool = await create_pool(dsn, min_size=1, max_size=3)
    agents: list[Agent] = []
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(_stop_on_signal_or_timer, stop, args.duration)
            tg.start_soon(lambda: serve(config, stop=stop, on_ready=on_ready))
            with anyio.fail_after(30):
                await port_ready.wait()
            url = f"ws://127.0.0.1:{ports[0]}/agent"
            print(f"server on http://127.0.0.1:{ports[0]}  (/status /metrics /healthz; agent token {token})",
                  flush=True)
            print(f"dashboard on http://127.0.0.1:{ports[0]}/ui  (admin token {ui_token})", flush=True)
            await demomix.setup(pool)
            for i in range(args.agents):
                agent = Agent(url, token, **demomix.agent_kwargs(i, args.capacity))
                agents.append(agent)
                tg.start_soon(agent.run)
            producer = Producer(pool, Mix(args.rate, args.job_seconds, demomix.fleet(args.agents)))
            tg.start_soon(producer.run, stop)
            await _progress(pool, producer, agents, stop)
            for agent in agents:
                agent.stop()
    finally:
        await pool.close()
    done = sum(a.completed for a in agents)
    print(f"stopped cleanly: {producer.enqueued} jobs enqueued, {done} completed by {len(agents)} agents",
          flush=True)


async def _progress(pool: object, producer: Producer, agents: list[Agent], stop: anyio.Event) -> None:
    last_enq, last_done, t0 = 0, 0, time.monotonic()
    while not stop.is_set():
        with anyio.move_on_after(1.0):
            await stop.wait()
        done = sum(a.completed for a in agents)
        counts = await admin.status_counts(pool)  # type: ignore[arg-type]
        connected = int(metrics.REGISTRY.get_sample_value("gpuq_agents_connected") or 0)
        print(f"t={time.monotonic() - t0:5.0f}s  enqueued {producer.enqueued:7d} ({producer.enqueued - last_enq:4d}/s)"
              f"  done {done:7d} ({done - last_done:4d}/s)  pending {counts.total('pending'):5d}"
              f"  leased {counts.total('leased'):4d}  agents {connected}", flush=True)
        last_enq, last_done = producer.enqueued, done


async def _stop_on_signal_or_timer(stop: anyio.Event, duration: float | None) -> None:
    with anyio.move_on_after(duration if duration is not None else float("inf")):
        await stop_on_signal(lambda: print("\nstopping ...", flush=True))
    stop.set()
