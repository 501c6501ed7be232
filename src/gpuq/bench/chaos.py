"""``gpuq bench chaos``: kill agents, dispatchers and PostgreSQL mid-run; nothing is lost.

Real processes on 127.0.0.1: two ``gpuq serve`` on one database (different
ports), ``--agents`` ``gpuq agent`` processes (half on each serve) whose
handler (:func:`record`) appends every execution (job id, lease token, pid)
to a file per process, and a producer inserting at a steady rate until
``--jobs`` rows exist. Meanwhile: SIGKILL a random agent every 1-2 s and
restart it, SIGKILL each dispatcher once (``--dispatcher-kills``, default 2)
and restart it on the same port, and restart PostgreSQL once with
``pg_ctl restart -m immediate`` (embedded cluster only). Then drain.

The verdict comes from the database, not from the processes' word:
- an ``AFTER UPDATE`` row trigger (schema ``gpuq_chaos``) records every
  UPDATE that leaves a row ``done`` (a transition, and also any rewrite of a
  done row), with the lease token the row held: >1 row per job is a double
  completion;
- a done job whose ``result.token`` is not the token of the lease that
  completed it is a result written by a losing lease;
- lost = inserted - done - dead (jobs still live after the drain count as lost).

Exit 1 when lost, double_completed or wrong_result is non-zero. The last
stdout line is one JSON object (see ``_summary``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from gpuq.bench.common import (
    add_common_args,
    emit,
    guarded,
    positive_int,
    progress,
    reset_gpuq_schema,
    target,
)
from gpuq.bench.procs import SERVE_ENV, Proc, spawn
from gpuq.bench.soak import count_errors
from gpuq.devdb import Cluster, free_port

KIND = "chaos"
TOKEN = "chaos-token"
EXEC_DIR_ENV = "GPUQ_CHAOS_DIR"  # where record() writes, one file per agent process
WORK_MS_ENV = "GPUQ_CHAOS_WORK_MS"  # mean simulated work per job

# --------------------------------------------------------------------------
# The agents' handler (``--handler gpuq.bench.chaos:record``)
# --------------------------------------------------------------------------

_exec_fd: int | None = None


async def record(job: Any) -> dict[str, Any]:
    """Log this execution (one O_APPEND write: survives a SIGKILL), work a little, return the token."""
    global _exec_fd
    if _exec_fd is None:
        directory = os.environ.get(EXEC_DIR_ENV) or tempfile.gettempdir()
        _exec_fd = os.open(os.path.join(directory, f"exec-{os.getpid()}.log"),
                           os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(_exec_fd, f"{job.id} {job.lease_token} {os.getpid()}\n".encode())
    work = float(os.environ.get(WORK_MS_ENV, "0") or 0) / 1000.0
    if work > 0:
        await asyncio.sleep(random.uniform(0, 2 * work))
    return {"token": job.lease_token}


def read_executions(directory: Path) -> list[tuple[int, str, int]]:
    """Every (job id, lease token, pid) the handlers recorded (torn lines are skipped)."""
    out: list[tuple[int, str, int]] = []
    for f in sorted(directory.glob("exec-*.log")):
        for line in f.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[0].isdigit() and parts[2].isdigit():
                out.append((int(parts[0]), parts[1], int(parts[2])))
    return out


# --------------------------------------------------------------------------
# Side schema: the completion witness
# --------------------------------------------------------------------------

_INSTALL = [
    "DROP SCHEMA IF EXISTS gpuq_chaos CASCADE",
    "CREATE SCHEMA gpuq_chaos",
    """CREATE TABLE gpuq_chaos.completions (
           job_id      bigint NOT NULL,
           old_status  text NOT NULL,
           lease_token uuid,
           result      jsonb,
           at          timestamptz NOT NULL DEFAULT clock_timestamp())""",
    """CREATE FUNCTION gpuq_chaos.record_completion() RETURNS trigger
       LANGUAGE plpgsql AS $$
       BEGIN
           INSERT INTO gpuq_chaos.completions (job_id, old_status, lease_token, result)
           VALUES (NEW.id, OLD.status::text, OLD.lease_token, NEW.result);
           RETURN NULL;
       END
       $$""",
    # Every UPDATE that leaves the row done: the transition, and any later
    # rewrite of an already done row (which would be a second completion too).
    """CREATE TRIGGER chaos_completions AFTER UPDATE ON gpuq.jobs
       FOR EACH ROW WHEN (NEW.status = 'done')
       EXECUTE FUNCTION gpuq_chaos.record_completion()""",
]
_UNINSTALL = "DROP TRIGGER IF EXISTS chaos_completions ON gpuq.jobs"



async def install_witness(conn: Any) -> None:
    """(Re)create schema gpuq_chaos and the completion trigger on gpuq.jobs."""
    for stmt in _INSTALL:
        await conn.execute(stmt)


async def witness(conn: Any) -> dict[str, int]:
    """What the completion trigger saw: jobs completed twice, results not from the winning lease."""
    double = int(await conn.fetchval(
        "SELECT count(*) FROM (SELECT job_id FROM gpuq_chaos.completions "
        "GROUP BY job_id HAVING count(*) > 1) d"))
    # The winning lease is the one the row held when it became done; its token
    # must be the one in the result (the handler returns the token it ran with).
    wrong = int(await conn.fetchval(
        "SELECT count(*) FROM gpuq.jobs j JOIN gpuq_chaos.completions c ON c.job_id = j.id "
        "WHERE j.status = 'done' "
        "AND (j.result->>'token' IS DISTINCT FROM c.lease_token::text "
        "     OR c.result->>'token' IS DISTINCT FROM c.lease_token::text)"))
    # A done row the trigger never saw become done (it would hide a completion).
    untracked = int(await conn.fetchval(
        "SELECT count(*) FROM gpuq.jobs j WHERE j.status = 'done' AND NOT EXISTS "
        "(SELECT 1 FROM gpuq_chaos.completions c WHERE c.job_id = j.id)"))
    return {"double_completed": double, "wrong_result": wrong + untracked}


_LIVE = ("SELECT count(*) FILTER (WHERE status = 'pending') AS pending, "
         "count(*) FILTER (WHERE status = 'leased') AS leased, "
         "count(*) FILTER (WHERE status = 'scheduled') AS scheduled "
         "FROM gpuq.jobs WHERE status IN ('pending', 'leased', 'scheduled')")

_INSERT = """
INSERT INTO gpuq.jobs (kind, payload, max_attempts)
SELECT $1, jsonb_build_object('seq', g), $3 FROM generate_series($2::bigint, $2::bigint + $4 - 1) AS g
"""


# --------------------------------------------------------------------------
# The run
# --------------------------------------------------------------------------


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


@dataclass
class Serve:
    index: int
    port: int
    proc: Proc | None = None
    incarnation: int = 0
    busy: bool = False  # being killed/restarted on purpose: not a crash


@dataclass
class AgentSlot:
    index: int
    serve: Serve
    proc: Proc | None = None
    incarnation: int = 0
    busy: bool = False


@dataclass
class Counters:
    inserted: int = 0  # what the producer knows is committed
    insert_errors: int = 0
    agent_kills: int = 0
    dispatcher_kills: int = 0
    pg_restarts: int = 0
    serve_crashes: int = 0  # a serve exited without being killed: a bug
    agent_crashes: int = 0
    crash_logs: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)


class ChaosRun:
    def __init__(self, dsn: str, cluster: Cluster | None, cfg: ChaosConfig):
        self.dsn, self.cluster, self.cfg = dsn, cluster, cfg
        self.rng = random.Random(cfg.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix="gpuq-chaos-"))
        self.execdir = self.workdir / "executions"
        self.execdir.mkdir()
        self.logdir = self.workdir / "logs"
        self.logdir.mkdir()
        self.serves = [Serve(i, free_port()) for i in range(2)]
        self.slots = [AgentSlot(i, self.serves[i % 2]) for i in range(cfg.agents)]
        self.c = Counters()
        self.t0 = time.monotonic()

    # -- processes -------------------------------------------------------

    def _note(self, msg: str) -> None:
        line = f"t={time.monotonic() - self.t0:6.1f}s {msg}"
        self.c.events.append(line)
        progress(f"chaos: {msg}")

    def _spawn_serve(self, s: Serve) -> None:
        s.incarnation += 1
        argv = ["-m", "gpuq.cli", "serve", "--database-url", self.dsn,
                "--listen", f"127.0.0.1:{s.port}", "--tokens", TOKEN,
                "--lease-seconds", str(self.cfg.lease_seconds),
                "--heartbeat-seconds", str(self.cfg.heartbeat_seconds),
                "--poll-seconds", "0.5", "--drain-seconds", "2",
                "--log-level", "warning", "--log-format", "json"]
        env = dict(SERVE_ENV, GPUQ_SWEEP_SECONDS="1")
        s.proc = spawn(f"serve-{s.index}.{s.incarnation}", argv, self.logdir, env)

    def _spawn_agent(self, a: AgentSlot) -> None:
        a.incarnation += 1
        argv = ["-m", "gpuq.cli", "agent", "--url", f"ws://127.0.0.1:{a.serve.port}/agent",
                "--token", TOKEN, "--kinds", KIND, "--capacity", str(self.cfg.capacity),
                "--handler", "gpuq.bench.chaos:record", "--name", f"chaos-{a.index}",
                "--log-level", "warning", "--log-format", "json"]
        env = {EXEC_DIR_ENV: str(self.execdir), WORK_MS_ENV: str(self.cfg.work_ms)}
        a.proc = spawn(f"agent-{a.index}.{a.incarnation}", argv, self.logdir, env)

    async def _wait_healthy(self, s: Serve, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if s.proc is None or not s.proc.alive():
                code = s.proc.popen.returncode if s.proc else None
                raise RuntimeError(f"serve-{s.index} exited ({code}); its log:\n"
                                   f"{s.proc.tail() if s.proc else ''}")
            if await asyncio.to_thread(_http_ok, s.port, "/healthz"):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"serve-{s.index} not healthy after {timeout:.0f}s")

    async def _wait_agents(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        want = {s.index: sum(1 for a in self.slots if a.serve is s) for s in self.serves}
        while time.monotonic() < deadline:
            got = {s.index: await asyncio.to_thread(_agents_connected, s.port) for s in self.serves}
            if all(got[i] >= n for i, n in want.items()):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"agents did not connect within {timeout:.0f}s")

    @staticmethod
    def _kill(p: Proc | None) -> None:
        if p is not None and p.alive():
            p.popen.send_signal(signal.SIGKILL)
            p.popen.wait(10)

    def _stop_all(self) -> None:
        for a in self.slots:
            if a.proc is not None and a.proc.alive():
                a.proc.popen.send_signal(signal.SIGTERM)
        for a in self.slots:
            if a.proc is not None:
                a.proc.stop(10)
        for s in self.serves:
            if s.proc is not None:
                s.proc.stop(20)

    # -- producer and chaos ---------------------------------------------

    async def _producer(self) -> None:
        cfg = self.cfg
        rate = cfg.jobs / max(cfg.seconds, 0.1)
        tick = 0.05
        conn: asyncpg.Connection | None = None
        start = time.monotonic()
        delay = 0.1
        while self.c.inserted < cfg.jobs:
            due = min(cfg.jobs, int((time.monotonic() - start) * rate) + 1)
            n = due - self.c.inserted
            try:
                if conn is None:
                    conn = await asyncpg.connect(self.dsn, timeout=5)
                    # After a failure we cannot know whether the last INSERT committed:
                    # count what is there (only this producer inserts).
                    self.c.inserted = int(await conn.fetchval("SELECT count(*) FROM gpuq.jobs"))
                    delay = 0.1
                    continue
                if n > 0:
                    await conn.execute(_INSERT, KIND, self.c.inserted + 1, cfg.max_attempts, n,
                                       timeout=10)
                    self.c.inserted += n
            except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                self.c.insert_errors += 1
                if self.c.insert_errors <= 3 or self.c.insert_errors % 20 == 0:
                    self._note(f"producer: insert failed ({type(exc).__name__}), reconnecting")
                if conn is not None:
                    conn.terminate()
                    conn = None
                await asyncio.sleep(delay)
                delay = min(delay * 2, 1.0)
                continue
            await asyncio.sleep(tick)
        if conn is not None:
            await conn.close()

    async def _agent_killer(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), self.rng.uniform(self.cfg.kill_min, self.cfg.kill_max))
                return
            except TimeoutError:
                pass
            a = self.rng.choice([x for x in self.slots if not x.busy] or self.slots)
            a.busy = True
            try:
                await asyncio.to_thread(self._kill, a.proc)
                self.c.agent_kills += 1
                self._spawn_agent(a)
            finally:
                a.busy = False

    async def _big_events(self) -> None:
        """Dispatcher kills and the PostgreSQL restart, spread over the production window."""
        cfg = self.cfg
        plan: list[tuple[float, str, int]] = []
        for k in range(cfg.dispatcher_kills):
            frac = 0.2 + 0.5 * (k / max(1, cfg.dispatcher_kills - 1)) if cfg.dispatcher_kills > 1 else 0.3
            plan.append((frac, "dispatcher", k % 2))
        if cfg.pg_restart and self.cluster is not None:
            plan.append((0.45, "postgres", 0))
        plan.sort()
        start = time.monotonic()
        for frac, what, idx in plan:
            await asyncio.sleep(max(0.0, start + frac * cfg.seconds - time.monotonic()))
            if what == "dispatcher":
                s = self.serves[idx]
                while s.busy:  # the watchdog is restarting it
                    await asyncio.sleep(0.1)
                s.busy = True
                try:
                    self._note(f"SIGKILL serve-{idx} (pid {s.proc.popen.pid if s.proc else '?'})")
                    await asyncio.to_thread(self._kill, s.proc)
                    self.c.dispatcher_kills += 1
                    self._spawn_serve(s)
                    await self._wait_healthy(s)
                    self._note(f"serve-{idx} back on port {s.port}")
                finally:
                    s.busy = False
            else:
                assert self.cluster is not None
                self._note("PostgreSQL restart -m immediate")
                await asyncio.to_thread(self.cluster.restart, "immediate")
                self.c.pg_restarts += 1
                self._note("PostgreSQL back")

    async def _watchdog(self, stop: asyncio.Event) -> None:
        """Count and restart processes that exit without being killed (each one is a bug)."""
        while not stop.is_set():
            for s in self.serves:
                if not s.busy and s.proc is not None and not s.proc.alive():
                    self.c.serve_crashes += 1
                    self.c.crash_logs.append(str(s.proc.log))
                    self._note(f"serve-{s.index} CRASHED (exit {s.proc.popen.returncode}), log "
                               f"{s.proc.log}; restarting it")
                    s.busy = True
                    try:
                        self._spawn_serve(s)
                        await self._wait_healthy(s)
                    finally:
                        s.busy = False
            for a in self.slots:
                if not a.busy and a.proc is not None and not a.proc.alive():
                    self.c.agent_crashes += 1
                    self.c.crash_logs.append(str(a.proc.log))
                    self._note(f"agent-{a.index} exited by itself ({a.proc.popen.returncode}), log "
                               f"{a.proc.log}; restarting it")
                    self._spawn_agent(a)
            try:
                await asyncio.wait_for(stop.wait(), 0.2)
            except TimeoutError:
                pass

    async def _live(self) -> dict[str, int] | None:
        try:
            conn = await asyncpg.connect(self.dsn, timeout=5)
        except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
            return None
        try:
            r = await conn.fetchrow(_LIVE)
            return {k: int(r[k]) for k in ("pending", "leased", "scheduled")}
        finally:
            await conn.close()

    async def _drain(self) -> dict[str, int]:
        deadline = time.monotonic() + self.cfg.drain_timeout
        last: dict[str, int] = {}
        shown = 0.0
        while time.monotonic() < deadline:
            live = await self._live()
            if live is not None:
                last = live
                if not any(live.values()):
                    return live
            if time.monotonic() - shown > 5:
                shown = time.monotonic()
                progress(f"chaos: draining, live {last}")
            await asyncio.sleep(0.25)
        self._note(f"drain timed out after {self.cfg.drain_timeout:.0f}s with {last} live")
        return last

    # -- verdict ---------------------------------------------------------

    async def _verdict(self, live: dict[str, int]) -> dict[str, Any]:
        conn = await asyncpg.connect(self.dsn, timeout=10)
        try:
            await conn.execute(_UNINSTALL)
            inserted = int(await conn.fetchval("SELECT count(*) FROM gpuq.jobs"))
            done = int(await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = 'done'"))
            dead = int(await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = 'dead'"))
            w = await witness(conn)
            winners = await conn.fetch(
                "SELECT c.job_id, c.lease_token::text AS token FROM gpuq_chaos.completions c")
            attempts_max = int(await conn.fetchval("SELECT coalesce(max(attempts), 0) FROM gpuq.jobs"))
            dead_reasons = {str(r[0])[:80]: r[1] for r in await conn.fetch(
                "SELECT last_error, count(*) FROM gpuq.jobs WHERE status = 'dead' GROUP BY 1")}
        finally:
            await conn.close()
        execs = read_executions(self.execdir)
        seen = {(j, t) for j, t, _ in execs}
        not_executed = sum(1 for r in winners if (r["job_id"], r["token"]) not in seen)
        distinct = len({j for j, _, _ in execs})
        return {
            "inserted": inserted, "done": done, "dead": dead,
            "lost": inserted - done - dead, "live": sum(live.values()),
            "double_completed": w["double_completed"], "wrong_result": w["wrong_result"],
            "completed_without_execution": not_executed,
            "executions": len(execs), "duplicate_executions": len(execs) - distinct,
            "max_attempts_seen": attempts_max, "dead_reasons": dead_reasons,
        }

    # -- main ------------------------------------------------------------

    async def run(self) -> dict[str, Any]:
        cfg = self.cfg
        await reset_gpuq_schema(self.dsn)
        conn = await asyncpg.connect(self.dsn)
        try:
            await install_witness(conn)
        finally:
            await conn.close()
        ok = False
        try:
            for s in self.serves:
                self._spawn_serve(s)
            for s in self.serves:
                await self._wait_healthy(s)
            for a in self.slots:
                self._spawn_agent(a)
            await self._wait_agents()
            self._note(f"2 serves (ports {self.serves[0].port}, {self.serves[1].port}), "
                       f"{cfg.agents} agents up; producing {cfg.jobs} jobs over ~{cfg.seconds:.0f}s")
            self.t0 = t_start = time.monotonic()
            stop, stop_watch = asyncio.Event(), asyncio.Event()
            killer = asyncio.create_task(self._agent_killer(stop))
            events = asyncio.create_task(self._big_events())
            watch = asyncio.create_task(self._watchdog(stop_watch))
            try:
                try:
                    await self._producer()
                    self._note(f"producer done: {self.c.inserted} inserted "
                               f"({self.c.insert_errors} insert errors retried)")
                    await events
                finally:
                    stop.set()
                    await killer
                    events.cancel()
                self._note(f"chaos over: {self.c.agent_kills} agent kills, {self.c.dispatcher_kills} "
                           f"dispatcher kills, {self.c.pg_restarts} PostgreSQL restarts; draining")
                live = await self._drain()
            finally:
                stop_watch.set()
                await watch
            seconds = time.monotonic() - t_start
            serve_errors = sum(count_errors(s.read_text(errors="replace"))[0]
                               for s in self.logdir.glob("serve-*.log"))
            out = await self._verdict(live)
            out.update(agent_kills=self.c.agent_kills, dispatcher_kills=self.c.dispatcher_kills,
                       pg_restarts=self.c.pg_restarts, insert_errors=self.c.insert_errors,
                       serve_crashes=self.c.serve_crashes, agent_crashes=self.c.agent_crashes,
                       crash_logs=self.c.crash_logs, serve_error_lines=serve_errors,
                       seconds=round(seconds, 1), requested=cfg.jobs,
                       pg_restart_skipped=self.cluster is None and cfg.pg_restart)
            ok = failed(out) == []
            return out
        finally:
            await asyncio.to_thread(self._stop_all)
            await _uninstall_quietly(self.dsn)
            if ok and not cfg.keep_logs:
                shutil.rmtree(self.workdir, ignore_errors=True)
            else:
                progress(f"chaos: logs and execution records kept in {self.workdir}")


async def _uninstall_quietly(dsn: str) -> None:
    try:
        conn = await asyncpg.connect(dsn, timeout=10)
    except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError):
        return
    try:
        await conn.execute(_UNINSTALL)
    except asyncpg.PostgresError:
        pass
    finally:
        await conn.close()


def failed(out: dict[str, Any]) -> list[str]:
    """The guarantees the run broke (empty: all held)."""
    bad = [k for k in ("lost", "double_completed", "wrong_result", "serve_crashes")
           if out.get(k, 0) > 0]
    if out.get("inserted", 0) < out.get("requested", 0):
        bad.append("inserted<requested")
    return bad


async def run_chaos(dsn: str, cluster: Cluster | None, cfg: ChaosConfig) -> dict[str, Any]:
    """One chaos run on ``dsn`` (its gpuq schema is dropped and recreated)."""
    return await ChaosRun(dsn, cluster, cfg).run()


def _http_ok(port: int, path: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:  # noqa: S310
            return bool(json.loads(r.read()).get("ok"))
    except (OSError, ValueError):
        return False


def _agents_connected(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as r:  # noqa: S310
            return int(json.loads(r.read()).get("agents_connected", 0))
    except (OSError, ValueError):
        return 0


# --------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------


def _summary(out: dict[str, Any]) -> dict[str, Any]:
    keys = ("jobs", "done", "lost", "dead", "double_completed", "wrong_result", "duplicate_executions",
            "agent_kills", "dispatcher_kills", "pg_restarts", "seconds")
    res = {"bench": "chaos", "jobs": out["inserted"], **{k: out[k] for k in keys[1:]}}
    res.update(live=out["live"], executions=out["executions"], requested=out["requested"],
               completed_without_execution=out["completed_without_execution"],
               pg_restart_skipped=out["pg_restart_skipped"], serve_crashes=out["serve_crashes"],
               agent_crashes=out["agent_crashes"], serve_error_lines=out["serve_error_lines"],
               max_attempts_seen=out["max_attempts_seen"], dead_reasons=out["dead_reasons"])
    return res


def print_report(out: dict[str, Any]) -> None:
    rows = [
        ("jobs inserted", out["inserted"]), ("done", out["done"]), ("dead", out["dead"]),
        ("lost (inserted - done - dead)", out["lost"]), ("live after drain", out["live"]),
        ("completed twice", out["double_completed"]),
        ("results from a losing lease", out["wrong_result"]),
        ("completed without a recorded execution", out["completed_without_execution"]),
        ("executions", out["executions"]),
        ("duplicate executions (allowed)", out["duplicate_executions"]),
        ("highest attempts of a job", out["max_attempts_seen"]),
        ("agent SIGKILLs", out["agent_kills"]), ("dispatcher SIGKILLs", out["dispatcher_kills"]),
        ("PostgreSQL immediate restarts", out["pg_restarts"]),
        ("producer insert errors (retried)", out["insert_errors"]),
        ("serve crashes (exited unkilled: a bug)", out["serve_crashes"]),
        ("agent exits not caused by a kill", out["agent_crashes"]),
        ("ERROR/traceback lines in serve logs", out["serve_error_lines"]),
        ("seconds", out["seconds"]),
    ]
    width = max(len(k) for k, _ in rows)
    print("gpuq chaos run")
    for k, v in rows:
        print(f"  {k.ljust(width)}  {v:,}" if isinstance(v, int) else f"  {k.ljust(width)}  {v}")
    for path in out["crash_logs"]:
        print(f"  crash log: {path}")
    if out["pg_restart_skipped"]:
        print("  (PostgreSQL restart skipped: it needs the embedded cluster, not --database-url)")
    bad = failed(out)
    print("VERDICT: " + ("OK: nothing lost, nothing completed twice, every result from its lease"
                         if not bad else "FAILED: " + ", ".join(bad)))
    print()


def add_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--jobs", type=positive_int, default=20_000, help="jobs to insert (default 20000)")
    p.add_argument("--seconds", type=float, default=60.0,
                   help="spread the inserts (and the chaos) over this long (default 60)")
    p.add_argument("--agents", type=positive_int, default=6, help="agent processes (default 6)")
    p.add_argument("--capacity", type=positive_int, default=8, help="capacity of each agent (default 8)")
    p.add_argument("--work-ms", type=float, default=50.0, help="mean handler time per job (default 50)")
    p.add_argument("--dispatcher-kills", type=int, default=2, help="serve SIGKILLs (default 2)")
    p.add_argument("--no-pg-restart", action="store_true", help="skip the PostgreSQL restart")
    p.add_argument("--lease-seconds", type=float, default=5.0,
                   help="lease length of both serves (default 5: a killed dispatcher's leases "
                        "expire quickly)")
    p.add_argument("--drain-timeout", type=float, default=180.0,
                   help="give up waiting for the queue to empty after this long (default 180)")
    p.add_argument("--seed", type=int, default=None, help="seed of the kill schedule")
    p.add_argument("--keep-logs", action="store_true", help="keep process logs even on success")


def config_from_args(args: argparse.Namespace) -> ChaosConfig:
    return ChaosConfig(jobs=args.jobs, seconds=args.seconds, agents=args.agents, capacity=args.capacity,
                       work_ms=args.work_ms, dispatcher_kills=args.dispatcher_kills,
                       pg_restart=not args.no_pg_restart, lease_seconds=args.lease_seconds,
                       heartbeat_seconds=min(1.0, args.lease_seconds / 3),
                       drain_timeout=args.drain_timeout, seed=args.seed, keep_logs=args.keep_logs)


def bench(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)

    def run() -> int:
        with target(args) as (dsn, cluster):
            if cluster is None and cfg.pg_restart:
                print("NOTE: external database: the PostgreSQL restart step is skipped "
                      "(it needs the embedded cluster)", flush=True)
            out = asyncio.run(run_chaos(dsn, cluster, cfg))
        print_report(out)
        emit(_summary(out))
        return 1 if failed(out) else 0

    return guarded(run)


def register(sub: Any) -> None:
    p = sub.add_parser("chaos", help="kill agents, dispatchers and PostgreSQL mid-run: nothing lost, "
                       "nothing completed twice")
    add_args(p)
    p.set_defaults(bench=bench)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpuq bench chaos", description=__doc__.split("\n\n")[0])
    add_args(p)
    return bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
