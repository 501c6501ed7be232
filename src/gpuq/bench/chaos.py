"""``gpuq bench chaos``: kill agents, dispatchers and PostgreSQL mid-run; nothing is lost.

Real processes on 127.0.0.1: two ``gpuq serve`` on one database (different
ports), ``--agents`` ``gpuq agent`` processes (half on each serve) whose
handler (``gpuq.bench.handlers:record``) appends every execution (job id,
lease token, pid) to a file per process, and a producer inserting at a steady
rate until ``--jobs`` rows exist. With ``--batch N`` the kind has a batching
policy of N items and every other agent takes batches
(``gpuq.bench.handlers:record_batch``): batched and one-by-one agents share
the kind. Meanwhile: SIGKILL a random agent every
1-2 s and restart it, SIGKILL each dispatcher once (``--dispatcher-kills``,
default 2) and restart it on the same port, and restart PostgreSQL once with
``pg_ctl restart -m immediate`` (embedded cluster only). With ``--preempt S``
the jobs are preemptible (1 s of grace) and every ~S seconds a few running
jobs, picked at random, are asked to yield (``gpuq.preempt``); the handler
(``record_yielding``) stops at once when asked, and the job runs again. Then
drain.

The verdict comes from the database, not from the processes' word (the SQL
witness is ``witness_*`` in bench/queries.sql):
- an ``AFTER UPDATE`` row trigger records every UPDATE that leaves a row
  ``done``, with the lease token the row held: >1 row per job is a double
  completion;
- a done job whose ``result.token`` is not the token of the lease that
  completed it is a result written by a losing lease;
- lost = inserted - done - dead (jobs still live after the drain count as lost).

Exit 1 when lost, double_completed or wrong_result is non-zero.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from gpuq import admin
from gpuq.bench import common
from gpuq.bench.handlers import EXEC_DIR_ENV, WORK_MS_ENV
from gpuq.bench.measure import count_errors
from gpuq.devdb import Cluster, free_port
from gpuq.harness import UNLIMITED_ENV, Proc, agent_argv, http_json, serve_argv, spawn

KIND = "chaos"
DB_ERRORS = (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError)


# -- the witness -------------------------------------------------------------


async def install_witness(conn: Any) -> None:
    """(Re)create schema gpuq_chaos and the completion trigger on gpuq.jobs."""
    await conn.execute(common.queries["witness_install"])


async def witness(conn: Any) -> dict[str, int]:
    """What the completion trigger saw: jobs completed twice, results not from the winning lease."""
    return {k: int(v) for k, v in (await conn.fetchrow(common.queries["witness_verdict"])).items()}


def read_executions(directory: Path) -> list[tuple[int, str, int]]:
    """Every (job id, lease token, pid) the handlers recorded (torn lines are skipped)."""
    out: list[tuple[int, str, int]] = []
    for f in sorted(directory.glob("exec-*.log")):
        for line in f.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
                out.append((int(parts[0]), parts[1], int(parts[2])))
    return out


# -- the run -------------------------------------------------------------------


@dataclass
class ChaosConfig:
    jobs: int = 20_000
    seconds: float = 60.0  # the producer spreads the inserts over this long; chaos runs meanwhile
    agents: int = 6
    capacity: int = 8
    work_ms: float = 50.0
    kill_min: float = 1.0
    kill_max: float = 2.0
    dispatcher_kills: int = 2
    pg_restart: bool = True
    lease_seconds: float = 5.0
    heartbeat_seconds: float = 1.0
    max_attempts: int = 25
    drain_timeout: float = 180.0
    seed: int | None = None
    keep_logs: bool = False
    batch: int = 0  # the kind's batching policy (items); every other agent takes batches (0: none)
    preempt_every: float = 0.0  # ask a few running jobs to yield about this often (0: no preemption)


@dataclass(eq=False)
class Member:
    """A process the run keeps alive: a serve (``serve`` None) or an agent of that serve."""

    name: str
    port: int
    serve: Member | None = None
    proc: Proc | None = None
    incarnation: int = 0
    busy: bool = False  # being killed or restarted on purpose: an exit now is not a crash


@dataclass
class Counters:
    inserted: int = 0  # what the producer knows is committed
    insert_errors: int = 0
    agent_kills: int = 0
    dispatcher_kills: int = 0
    pg_restarts: int = 0
    preempts_asked: int = 0  # jobs gpuq.preempt asked to yield
    serve_crashes: int = 0  # a serve exited without being killed: a bug
    agent_crashes: int = 0
    crash_logs: list[str] = field(default_factory=list)


class ChaosRun:
    def __init__(self, dsn: str, cluster: Cluster | None, cfg: ChaosConfig):
        self.dsn, self.cluster, self.cfg = dsn, cluster, cfg
        self.rng = random.Random(cfg.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix="gpuq-chaos-"))
        self.execdir, self.logdir = self.workdir / "executions", self.workdir / "logs"
        self.execdir.mkdir()
        self.logdir.mkdir()
        self.serves = [Member(f"serve-{i}", free_port()) for i in range(2)]
        self.agents = [Member(f"agent-{i}", 0, self.serves[i % 2]) for i in range(cfg.agents)]
        self.c = Counters()
        self.t0 = time.monotonic()

    def _note(self, msg: str) -> None:
        common.progress(f"chaos: t={time.monotonic() - self.t0:6.1f}s {msg}")

    def _spawn(self, m: Member) -> None:
        m.incarnation += 1
        if m.serve is None:
            argv = serve_argv(self.dsn, m.port, lease_seconds=self.cfg.lease_seconds,
                              heartbeat_seconds=self.cfg.heartbeat_seconds, poll_seconds=0.5, drain_seconds=2)
            env = dict(UNLIMITED_ENV, GPUQ_SWEEP_SECONDS="1")
        else:
            batches: dict[str, Any] = {"batch_handler": "gpuq.bench.handlers:record_batch", "max_batch": self.cfg.batch}
            handler = "gpuq.bench.handlers:record_yielding" if self.cfg.preempt_every else "gpuq.bench.handlers:record"
            argv = agent_argv(f"ws://127.0.0.1:{m.serve.port}/agent", f"chaos-{m.name}", handler,
                              self.cfg.capacity, kinds=KIND,
                              **(batches if self.cfg.batch and self.agents.index(m) % 2 else {}))
            env = {EXEC_DIR_ENV: str(self.execdir), WORK_MS_ENV: str(self.cfg.work_ms)}
        m.proc = spawn(f"{m.name}.{m.incarnation}", argv, self.logdir, env)

    async def _restart(self, m: Member, kill: bool) -> None:
        """Kill (or find dead) and start again; a serve is waited for until healthy."""
        m.busy = True
        try:
            if kill and m.proc is not None:
                await anyio.to_thread.run_sync(m.proc.kill)
            self._spawn(m)
            if m.serve is None:
                await self._until(lambda: bool(http_json(m.port, "/healthz").get("ok")), f"{m.name} healthy", m)
        finally:
            m.busy = False

    async def _until(self, ok: Any, what: str, serve: Member | None = None, timeout: float = 60.0) -> None:
        with anyio.fail_after(timeout):
            while not await anyio.to_thread.run_sync(ok):
                if serve is not None and serve.proc is not None and not serve.proc.alive():
                    raise RuntimeError(f"{serve.name} exited; its log:\n{serve.proc.tail()}")
                await anyio.sleep(0.1)

    async def _producer(self) -> None:
        """Insert at a steady rate until ``jobs`` rows exist, reconnecting through the outages."""
        rate, conn, start = self.cfg.jobs / max(self.cfg.seconds, 0.1), None, time.monotonic()
        while self.c.inserted < self.cfg.jobs:
            n = min(self.cfg.jobs, int((time.monotonic() - start) * rate) + 1) - self.c.inserted
            try:
                if conn is None:
                    conn = await asyncpg.connect(self.dsn, timeout=5)
                    # After a failure the last INSERT may or may not have committed: count.
                    self.c.inserted = int(await conn.fetchval(common.queries["count_all"]))
                    continue
                if n > 0:
                    await conn.execute(common.queries["insert_sequence"], KIND, self.c.inserted + 1,
                                       self.cfg.max_attempts, n, self.cfg.preempt_every > 0, timeout=10)
                    self.c.inserted += n
            except DB_ERRORS as exc:
                self.c.insert_errors += 1
                if self.c.insert_errors <= 3 or self.c.insert_errors % 20 == 0:
                    self._note(f"producer: insert failed ({type(exc).__name__}), reconnecting")
                if conn is not None:
                    conn.terminate()
                conn = None
                await anyio.sleep(0.2)
                continue
            await anyio.sleep(0.05)
        if conn is not None:
            await conn.close()

    async def _agent_killer(self) -> None:
        while True:
            await anyio.sleep(self.rng.uniform(self.cfg.kill_min, self.cfg.kill_max))
            await self._restart(self.rng.choice([a for a in self.agents if not a.busy] or self.agents), True)
            self.c.agent_kills += 1

    async def _preempter(self) -> None:
        """Every ~``preempt_every`` seconds ask up to 3 running jobs to yield (through the outages)."""
        while True:
            await anyio.sleep(self.rng.uniform(0.5, 1.5) * self.cfg.preempt_every)
            try:
                conn = await asyncpg.connect(self.dsn, timeout=5)
                try:
                    self.c.preempts_asked += len(await conn.fetch(common.queries["preempt_some"], 3, timeout=5))
                finally:
                    await conn.close()
            except DB_ERRORS:
                pass  # PostgreSQL restarting: the next one

    async def _big_events(self) -> None:
        """Dispatcher kills and the PostgreSQL restart, spread over the production window."""
        k = self.cfg.dispatcher_kills
        plan = [(0.2 + 0.5 * i / (k - 1) if k > 1 else 0.3, i % 2) for i in range(k)]
        if self.cfg.pg_restart and self.cluster is not None:
            plan.append((0.45, -1))
        start = time.monotonic()
        for frac, idx in sorted(plan):
            await anyio.sleep(max(0.0, start + frac * self.cfg.seconds - time.monotonic()))
            if idx < 0:
                assert self.cluster is not None
                self._note("PostgreSQL restart -m immediate")
                await anyio.to_thread.run_sync(self.cluster.restart, "immediate")
                self.c.pg_restarts += 1
                continue
            s = self.serves[idx]
            while s.busy:  # the watchdog is restarting it
                await anyio.sleep(0.1)
            self._note(f"SIGKILL {s.name}")
            await self._restart(s, True)
            self.c.dispatcher_kills += 1

    async def _watchdog(self) -> None:
        """Count and restart processes that exit without being killed (each one is a bug)."""
        while True:
            for m in [*self.serves, *self.agents]:
                if not m.busy and m.proc is not None and not m.proc.alive():
                    self.c.crash_logs.append(str(m.proc.log))
                    if m.serve is None:
                        self.c.serve_crashes += 1
                    else:
                        self.c.agent_crashes += 1
                    self._note(f"{m.name} exited by itself ({m.proc.popen.returncode}), log {m.proc.log}")
                    await self._restart(m, False)
            await anyio.sleep(0.2)

    async def _drain(self) -> dict[str, int]:
        last: dict[str, int] = {}
        with anyio.move_on_after(self.cfg.drain_timeout):
            while True:
                try:
                    conn = await asyncpg.connect(self.dsn, timeout=5)
                    try:
                        last = dict(await conn.fetchrow(common.queries["live_by_state"]))
                    finally:
                        await conn.close()
                except DB_ERRORS:
                    pass
                if last and not any(last.values()):
                    return last
                await anyio.sleep(0.25)
        self._note(f"drain timed out after {self.cfg.drain_timeout:.0f}s with {last} live")
        return last

    async def _verdict(self, live: dict[str, int]) -> dict[str, Any]:
        conn = await asyncpg.connect(self.dsn, timeout=10)
        try:
            await conn.execute(common.queries["witness_uninstall"])
            totals = dict(await conn.fetchrow(common.queries["totals"]))
            w = await witness(conn)
            winners = {(r["job_id"], r["token"]) for r in await conn.fetch(common.queries["chaos_winners"])}
            dead_reasons = {str(r[0])[:80]: r[1] for r in await conn.fetch(common.queries["chaos_dead_reasons"])}
        finally:
            await conn.close()
        execs = read_executions(self.execdir)
        seen = {(j, t) for j, t, _ in execs}
        return {**totals, "lost": totals["inserted"] - totals["done"] - totals["dead"], "live": sum(live.values()),
                **w, "completed_without_execution": len(winners - seen), "executions": len(execs),
                "duplicate_executions": len(execs) - len({j for j, _, _ in execs}), "dead_reasons": dead_reasons}

    async def run(self) -> dict[str, Any]:
        await common.reset_gpuq_schema(self.dsn)
        conn = await asyncpg.connect(self.dsn)
        try:
            await install_witness(conn)
            if self.cfg.batch:
                await admin.set_batching(conn, KIND, self.cfg.batch)
        finally:
            await conn.close()
        out: dict[str, Any] = {}
        try:
            for s in self.serves:
                await self._restart(s, False)
            for a in self.agents:
                self._spawn(a)
            await self._until(lambda: all(http_json(s.port, "/status").get("agents_connected", 0) >= len(
                [a for a in self.agents if a.serve is s]) for s in self.serves), "agents connected")
            self._note(f"2 serves, {self.cfg.agents} agents up; producing {self.cfg.jobs} jobs "
                       f"over ~{self.cfg.seconds:.0f}s")
            self.t0 = time.monotonic()
            async with anyio.create_task_group() as watch:
                watch.start_soon(self._watchdog)
                async with anyio.create_task_group() as chaos:
                    chaos.start_soon(self._agent_killer)
                    if self.cfg.preempt_every:
                        chaos.start_soon(self._preempter)
                    async with anyio.create_task_group() as window:  # both end: the killer stops
                        window.start_soon(self._producer)
                        window.start_soon(self._big_events)
                    chaos.cancel_scope.cancel()
                self._note(f"chaos over: {self.c.agent_kills} agent kills, {self.c.dispatcher_kills} "
                           f"dispatcher kills, {self.c.pg_restarts} PostgreSQL restarts; draining")
                live = await self._drain()
                watch.cancel_scope.cancel()
            serve_errors = sum(count_errors(f.read_text(errors="replace"))[0] for f in self.logdir.glob("serve-*.log"))
            out = await self._verdict(live)
            c = self.c
            out.update(agent_kills=c.agent_kills, dispatcher_kills=c.dispatcher_kills, pg_restarts=c.pg_restarts,
                       preempts_asked=c.preempts_asked,
                       insert_errors=c.insert_errors, serve_crashes=c.serve_crashes,
                       agent_crashes=c.agent_crashes, crash_logs=c.crash_logs, serve_error_lines=serve_errors,
                       seconds=round(time.monotonic() - self.t0, 1), requested=self.cfg.jobs,
                       pg_restart_skipped=self.cluster is None and self.cfg.pg_restart)
            return out
        finally:
            for m in [*self.agents, *self.serves]:
                if m.proc is not None:
                    await anyio.to_thread.run_sync(m.proc.stop, 20)
            await _uninstall_quietly(self.dsn)
            if out and not failed(out) and not self.cfg.keep_logs:
                shutil.rmtree(self.workdir, ignore_errors=True)
            else:
                common.progress(f"chaos: logs and execution records kept in {self.workdir}")


async def _uninstall_quietly(dsn: str) -> None:
    try:
        conn = await asyncpg.connect(dsn, timeout=10)
        try:
            await conn.execute(common.queries["witness_uninstall"])
        finally:
            await conn.close()
    except DB_ERRORS:
        pass


def failed(out: dict[str, Any]) -> list[str]:
    """The guarantees the run broke (empty: all held)."""
    bad = [k for k in ("lost", "double_completed", "wrong_result", "serve_crashes") if out.get(k, 0) > 0]
    if out.get("inserted", 0) < out.get("requested", 0):
        bad.append("inserted<requested")
    return bad


async def run_chaos(dsn: str, cluster: Cluster | None, cfg: ChaosConfig) -> dict[str, Any]:
    """One chaos run on ``dsn`` (its gpuq schema is dropped and recreated)."""
    return await ChaosRun(dsn, cluster, cfg).run()


# -- gpuq bench chaos ----------------------------------------------------------

SUMMARY = ("done", "done_in_batches", "lost", "dead", "double_completed", "wrong_result", "duplicate_executions", "agent_kills",
           "dispatcher_kills", "pg_restarts", "seconds", "live", "executions", "requested",
           "completed_without_execution", "pg_restart_skipped", "serve_crashes", "agent_crashes",
           "serve_error_lines", "max_attempts_seen", "dead_reasons", "preempts_asked", "preemptions")


def report(out: dict[str, Any]) -> None:
    common.print_pairs("gpuq chaos run", [(k.replace("_", " "), out[k]) for k in (
        "inserted", "done", "done_in_batches", "dead", "lost", "live", "double_completed", "wrong_result",
        "completed_without_execution", "executions", "duplicate_executions", "max_attempts_seen", "agent_kills",
        "dispatcher_kills", "pg_restarts", "preempts_asked", "preemptions", "insert_errors", "serve_crashes",
        "agent_crashes",
        "serve_error_lines", "seconds")] + [("crash log", p) for p in out["crash_logs"]])
    if out["pg_restart_skipped"]:
        print("(PostgreSQL restart skipped: it needs the embedded cluster, not --database-url)")


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        common.positive(p, "--jobs", 20_000, "jobs to insert")
        p.add_argument("--seconds", type=float, default=60.0,
                       help="spread the inserts (and the chaos) over this long (default 60)")
        common.fleet_args(p, agents=6, capacity=8)
        p.add_argument("--work-ms", type=float, default=50.0, help="mean handler time per job (default 50)")
        p.add_argument("--dispatcher-kills", type=int, default=2, help="serve SIGKILLs (default 2)")
        p.add_argument("--no-pg-restart", action="store_true", help="skip the PostgreSQL restart")
        p.add_argument("--lease-seconds", type=float, default=5.0,
                       help="lease length of both serves (default 5: a killed dispatcher's leases expire quickly)")
        p.add_argument("--drain-timeout", type=float, default=180.0,
                       help="give up waiting for the queue to empty after this long (default 180)")
        p.add_argument("--seed", type=int, default=None, help="seed of the kill schedule")
        p.add_argument("--keep-logs", action="store_true", help="keep process logs even on success")
        p.add_argument("--batch", type=int, default=0,
                       help="batch the kind, N items a batch, on every other agent (default 0: no batching)")
        p.add_argument("--preempt", type=float, default=0.0, metavar="SECONDS",
                       help="preemptible jobs, a few running ones asked to yield about every SECONDS "
                            "(default 0: no preemption)")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        cfg = ChaosConfig(jobs=a.jobs, seconds=a.seconds, agents=a.agents, capacity=a.capacity,
                          work_ms=a.work_ms, dispatcher_kills=a.dispatcher_kills, pg_restart=not a.no_pg_restart,
                          lease_seconds=a.lease_seconds, heartbeat_seconds=min(1.0, a.lease_seconds / 3),
                          drain_timeout=a.drain_timeout, seed=a.seed, keep_logs=a.keep_logs, batch=a.batch,
                          preempt_every=a.preempt)
        return await run_chaos(t.dsn, t.cluster, cfg)

    common.declare(sub, "chaos", "kill agents, dispatchers and PostgreSQL mid-run: nothing lost, nothing completed "
            "twice", __doc__, args, body, report, failed,
            summary=lambda out: {"bench": "chaos", "jobs": out["inserted"], **{k: out[k] for k in SUMMARY}})


if __name__ == "__main__":
    raise SystemExit(common.standalone("chaos"))
