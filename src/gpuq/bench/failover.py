"""``gpuq bench failover``: a PostgreSQL failover under load, counted from the new primary.

Each variant builds its own pair on this machine from the PostgreSQL binaries
(``gpuq.replica``: a primary, a ``pg_basebackup -R`` standby with a slot), then
runs two ``gpuq serve`` (``--agents`` agents, split over them) on the
multi-host DSN ``postgresql://gpuq@127.0.0.1:P1,127.0.0.1:P2/postgres?target_session_attrs=read-write``,
a producer enqueuing at ``--rate`` that keeps a ledger (id -> payload) of what
it was told was committed, and ``--waiters`` ``gpuq.wait`` calls on jobs that
are running when the failure comes. The failure, per variant:

- ``sync``: synchronous standby; the primary killed (``pg_ctl stop -m immediate``),
  the standby promoted ``--promote-after`` seconds later;
- ``async``: the same with asynchronous replication (what it loses is reported, not judged);
- ``readonly``: synchronous; the primary fenced (``ALTER SYSTEM SET
  default_transaction_read_only``, reload, every client session terminated) and
  left running read-only, then the standby promoted;
- ``blackhole``: synchronous; the DSN's first host is a TCP proxy in front of the
  primary that stops passing bytes without closing anything (``gpuq.tcpproxy``),
  then the standby promoted.

Everything is counted from the new primary, never from acks: ``lost`` (ledger
ids missing), ``id_mismatch`` (a ledger id holding another payload: with
asynchronous replication an id can be handed out twice), ``not_done`` (ledger
jobs not done after ``--drain-timeout``), ``wrong`` (a done job whose result is
not the one function of its payload), ``reexecuted`` (jobs the handlers' logs
show run twice) against ``inflight_at_kill`` (leased on the standby just before
its promotion), ``serve_exits``/``agent_exits`` (processes that died by
themselves), ``waiters_failed`` (a wait that hung past its timeout, raised, was
wrong, or returned more than 5 s after its job was done), ``recovery_s``
(promotion to the first job done, by the new primary's ``finished_at``).

Exit 1 when a must-pass variant (sync, readonly, blackhole) breaks issue #29's
thresholds: any of the counts above non-zero, ``reexecuted > inflight_at_kill``,
or ``recovery_s`` over 10 s or never.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from gpuq import producer
from gpuq.bench import common
from gpuq.bench.chaos import read_executions
from gpuq.bench.handlers import EXEC_DIR_ENV, failover_answer
from gpuq.db import RETRYABLE_ERRORS, connect
from gpuq.devdb import free_port
from gpuq.harness import UNLIMITED_ENV, Proc, agent_argv, http_json, serve_argv, spawn
from gpuq.jobs import NewJob
from gpuq.migrate import migrate
from gpuq.replica import StandbyPair
from gpuq.tcpproxy import TcpProxy

KIND = "failover"
VARIANTS = ("sync", "async", "readonly", "blackhole")
MUST_PASS = ("sync", "readonly", "blackhole")
KEYS = ("lost", "id_mismatch", "not_done", "wrong", "reexecuted", "inflight_at_kill", "serve_exits", "agent_exits",
        "waiters_failed", "recovery_s")
ZERO = ("lost", "id_mismatch", "not_done", "wrong", "serve_exits", "agent_exits", "waiters_failed")
RECOVERY_LIMIT_S = 10.0  # issue #29: the first job done at most this long after a writable primary is back
WAITER_MARGIN_S = 5.0  # a waiter may return this long after its job is done, or after its own timeout
CONNECT_S, STATEMENT_S = 15.0, 10.0  # the bench's own bounds on the producer's connects and statements
AGENT_DRAIN_S = 5  # the agents' stop deadline (GPUQ_AGENT_DRAIN_SECONDS): without one they wait for ever
STOP_GRACE_S = 15.0  # SIGTERM to SIGKILL at the end: above serve's drain (2 s) + database bound (5 s), and agents' 5 s
DB_ERRORS = RETRYABLE_ERRORS  # TimeoutError among them


@dataclass
class FailoverConfig:
    seconds: float = 20.0  # the producer's window; the failure comes at fail_at of it
    fail_at: float = 0.4
    promote_after: float = 2.0
    rate: float = 40.0
    agents: int = 4
    capacity: int = 4
    work_ms: float = 100.0
    waiters: int = 8
    wait_timeout: float = 30.0
    drain_timeout: float = 40.0
    lease_seconds: float = 5.0
    seed: int | None = None
    keep_logs: bool = False


# -- the producer and the waiters -------------------------------------------------


class Producer:
    """Enqueues through the multi-host DSN; ``ledger`` holds what it was told was committed."""

    def __init__(self, dsn: str, rng: random.Random):
        self.dsn, self.rng = dsn, rng
        self.ledger: dict[int, dict[str, Any]] = {}
        self.errors = 0
        self.n = 0
        self._conn: Any = None
        self._lock = anyio.Lock()  # the steady stream and the waiters' jobs share the one connection

    def payload(self, sleep: float) -> dict[str, Any]:
        self.n += 1
        return {"n": self.n, "x": self.rng.getrandbits(48), "sleep": round(sleep, 3)}

    async def submit(self, payloads: list[dict[str, Any]]) -> list[int]:
        """One statement; on any failure (raised) none of them is in the ledger: unknown is not acked."""
        async with self._lock:
            return await self._submit(payloads)

    async def _submit(self, payloads: list[dict[str, Any]]) -> list[int]:
        try:
            if self._conn is None:
                with anyio.fail_after(CONNECT_S):
                    self._conn = await connect(self.dsn)
            with anyio.fail_after(STATEMENT_S):
                ids = await producer.enqueue_many(self._conn, [NewJob(KIND, p) for p in payloads])
        except DB_ERRORS:
            self.errors += 1
            self.close()
            raise
        self.ledger.update(zip(ids, payloads, strict=True))
        return ids

    async def run(self, seconds: float, rate: float, work_s: float) -> None:
        start, sent = time.monotonic(), 0
        while (elapsed := time.monotonic() - start) < seconds:
            if (due := min(int(elapsed * rate) + 1 - sent, int(rate) + 1)) > 0:
                sent = int(elapsed * rate) + 1
                try:
                    await self.submit([self.payload(self.rng.uniform(0, 2 * work_s)) for _ in range(due)])
                except DB_ERRORS:
                    await anyio.sleep(0.2)
                    continue
            await anyio.sleep(0.05)
        self.close()

    def close(self) -> None:
        if self._conn is not None:
            self._conn.terminate()  # never waits on a peer that may be gone
            self._conn = None


@dataclass
class WaitOutcome:
    job_id: int
    outcome: str  # ok, wrong, timeout, hung, or the exception's name
    returned_at: float  # wall clock


class Waiters:
    """``gpuq.wait`` on a DSN, each bounded by the bench too: past its timeout + margin it is 'hung'."""

    def __init__(self, dsn: str, timeout: float):
        self.dsn, self.timeout = dsn, timeout
        self.outcomes: list[WaitOutcome] = []

    async def wait_one(self, job_id: int, payload: dict[str, Any]) -> None:
        outcome = "hung"
        with anyio.move_on_after(self.timeout + WAITER_MARGIN_S):
            try:
                got = await producer.wait(self.dsn, job_id, timeout=self.timeout)
                outcome = "ok" if got == failover_answer(payload) else "wrong"
            except producer.WaitTimeout:
                outcome = "timeout"
            except Exception as exc:  # noqa: BLE001 - any other end of a wait is a failed waiter
                outcome = type(exc).__name__
        self.outcomes.append(WaitOutcome(job_id, outcome, time.time()))

    def failed(self, finished: dict[int, float | None]) -> list[str]:
        """Waiters that hung, raised, were wrong, or returned late after their job was done."""
        bad = []
        for w in self.outcomes:
            done_at = finished.get(w.job_id)
            late = done_at is not None and w.returned_at > done_at + WAITER_MARGIN_S
            if w.outcome not in ("ok", "timeout") or late:
                bad.append(f"{w.job_id}:{w.outcome}{' late' if late else ''}")
        return bad


# -- the processes ------------------------------------------------------------------


@dataclass
class Processes:
    """Two ``gpuq serve`` on the multi-host DSN and the agents, split over them."""

    dsn: str
    cfg: FailoverConfig
    workdir: Path
    serves: list[tuple[int, Proc]] = field(default_factory=list)
    agents: list[Proc] = field(default_factory=list)
    exited: dict[str, int | None] = field(default_factory=dict)  # name -> exit code, died by itself

    def start(self) -> None:
        env = dict(UNLIMITED_ENV, GPUQ_SWEEP_SECONDS="1")
        for i in range(2):
            port = free_port()
            argv = serve_argv(self.dsn, port, lease_seconds=self.cfg.lease_seconds, heartbeat_seconds=1,
                              poll_seconds=0.5, drain_seconds=2)
            self.serves.append((port, spawn(f"serve-{i}", argv, self.workdir, env)))
        self._until(lambda: all(http_json(p, "/healthz").get("ok") for p, _ in self.serves), "serves healthy")
        for i in range(self.cfg.agents):
            port = self.serves[i % 2][0]
            argv = agent_argv(f"ws://127.0.0.1:{port}/agent", f"failover-{i}", "gpuq.bench.handlers:failover",
                              self.cfg.capacity, kinds=KIND)
            env = {EXEC_DIR_ENV: str(self.workdir), "GPUQ_AGENT_DRAIN_SECONDS": str(AGENT_DRAIN_S)}
            self.agents.append(spawn(f"agent-{i}", argv, self.workdir, env))
        self._until(lambda: sum(http_json(p, "/status").get("agents_connected", 0) for p, _ in self.serves)
                    >= self.cfg.agents, "agents connected")

    def _until(self, ok: Any, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            self.check()
            if self.exited or time.monotonic() > deadline:
                raise RuntimeError(f"failover: {what}: not within {timeout:.0f} s (exited: {self.exited})")
            time.sleep(0.1)

    @property
    def procs(self) -> list[Proc]:
        return [p for _, p in self.serves] + self.agents

    def check(self) -> None:
        """Note every process that died by itself (it is not restarted: each one is a failure)."""
        for p in self.procs:
            if p.name not in self.exited and not p.alive():
                self.exited[p.name] = p.popen.returncode
                common.progress(f"failover: {p.name} exited by itself ({p.popen.returncode}); log {p.log}")

    def stop(self) -> list[str]:
        """SIGTERM to all at once; SIGKILL to what still runs after STOP_GRACE_S. Returns those."""
        self.check()
        for p in self.procs:
            if p.alive():
                p.popen.send_signal(signal.SIGTERM)
        deadline, ignored = time.monotonic() + STOP_GRACE_S, []
        for p in self.procs:
            while p.alive() and time.monotonic() < deadline:
                time.sleep(0.05)
            if p.alive():
                ignored.append(p.name)
                p.kill()
        return ignored


# -- one variant ----------------------------------------------------------------


class FailoverRun:
    def __init__(self, variant: str, cfg: FailoverConfig):
        self.variant, self.cfg = variant, cfg
        self.rng = random.Random(cfg.seed)
        self.workdir = Path(tempfile.mkdtemp(prefix=f"gpuq-failover-{variant}-"))
        self.pair: StandbyPair | None = None
        self.proxy: TcpProxy | None = None
        self.inflight: set[int] = set()
        self.fault_at = self.promoted_at = 0.0  # wall clock

    def _note(self, msg: str) -> None:
        common.progress(f"failover {self.variant}: {msg}")

    async def run(self) -> dict[str, Any]:
        self.pair = await anyio.to_thread.run_sync(StandbyPair.start, self.variant != "async")
        out: dict[str, Any] = {}
        procs: Processes | None = None
        try:
            if self.variant == "blackhole":
                self.proxy = TcpProxy(self.pair.primary.port).start()
            dsn = self.pair.dsn(self.proxy.port if self.proxy else None)
            await self._prepare()
            procs = Processes(dsn, self.cfg, self.workdir)
            await anyio.to_thread.run_sync(procs.start)
            self._note(f"2 serves and {self.cfg.agents} agents on {dsn}")
            out = await self._load(dsn, procs)
            return out
        finally:
            if procs is not None:
                ignored = await anyio.to_thread.run_sync(procs.stop)
                out["sigterm_ignored"] = len(ignored)
                if ignored:
                    self._note(f"SIGKILLed after {STOP_GRACE_S:.0f} s of SIGTERM: {', '.join(ignored)}")
            if self.proxy is not None:
                self.proxy.close()
            await anyio.to_thread.run_sync(self.pair.destroy)
            if out and not failures_of(self.variant, out) and not self.cfg.keep_logs:
                shutil.rmtree(self.workdir, ignore_errors=True)
            else:
                self._note(f"process logs and execution records kept in {self.workdir}")

    async def _prepare(self) -> None:
        """The gpuq schema on the primary, and the standby caught up (synchronous when asked)."""
        assert self.pair is not None
        await migrate(self.pair.primary.dsn)
        conn = await asyncpg.connect(self.pair.primary.dsn, timeout=10)
        try:
            with anyio.fail_after(60):
                while True:
                    rows = await conn.fetch(common.queries["failover_replication"])
                    if any(r["state"] == "streaming" and (r["sync_state"] == "sync" or self.variant == "async")
                           for r in rows):
                        return
                    await anyio.sleep(0.05)
        finally:
            await conn.close()

    async def _load(self, dsn: str, procs: Processes) -> dict[str, Any]:
        """Produce, fail over at ``fail_at``, drain; then the verdict from the new primary."""
        prod, waiters = Producer(dsn, self.rng), Waiters(dsn, self.cfg.wait_timeout)
        window = max(self.cfg.seconds, self.cfg.seconds * self.cfg.fail_at + self.cfg.promote_after + 2)
        async with anyio.create_task_group() as watch:
            watch.start_soon(self._watch, procs)
            async with anyio.create_task_group() as tg:
                tg.start_soon(prod.run, window, self.cfg.rate, self.cfg.work_ms / 1000)
                tg.start_soon(self._fail_over, prod, waiters, tg)
            self._note(f"producer done ({len(prod.ledger)} acked, {prod.errors} failed statements); draining")
            await self._drain()
            watch.cancel_scope.cancel()
        procs.check()
        return await self._verdict(prod, waiters, procs)

    async def _watch(self, procs: Processes) -> None:
        while True:
            procs.check()
            await anyio.sleep(0.2)

    async def _fail_over(self, prod: Producer, waiters: Waiters, tg: Any) -> None:
        """Waiters on jobs that will be running at the failure; the failure; the promotion."""
        assert self.pair is not None
        fail_in = max(1.5, self.cfg.seconds * self.cfg.fail_at)
        await anyio.sleep(fail_in - 1.0)
        payloads = [prod.payload(self.cfg.promote_after + 2.0) for _ in range(self.cfg.waiters)]
        if payloads:
            for job_id, p in zip(await prod.submit(payloads), payloads, strict=True):
                tg.start_soon(waiters.wait_one, job_id, p)
        await anyio.sleep(1.0)
        self._note("the failure")
        self.fault_at = time.time()
        await self._inject()
        await anyio.sleep(self.cfg.promote_after)
        self.inflight = await self._leased_on_standby()
        await anyio.to_thread.run_sync(self.pair.promote)
        self.promoted_at = time.time()
        self._note(f"standby promoted ({len(self.inflight)} jobs were in flight)")

    async def _inject(self) -> None:
        assert self.pair is not None
        if self.variant in ("sync", "async"):
            await anyio.to_thread.run_sync(self.pair.kill_primary)
        elif self.variant == "blackhole":
            assert self.proxy is not None
            self.proxy.black_hole()
        else:  # readonly: the old primary stays up, fenced
            conn = await asyncpg.connect(self.pair.primary.dsn, timeout=10)
            try:
                await conn.execute(common.queries["failover_fence"])
                await conn.execute(common.queries["failover_reload"])
                await anyio.sleep(0.2)  # the postmaster reads the file before the sessions come back
                await conn.execute(common.queries["failover_terminate"])
            finally:
                await conn.close()

    async def _leased_on_standby(self) -> set[int]:
        assert self.pair is not None
        conn = await asyncpg.connect(self.pair.standby.dsn, timeout=10)
        try:
            return {r["id"] for r in await conn.fetch(common.queries["failover_leased"], timeout=10)}
        finally:
            await conn.close()

    async def _drain(self) -> None:
        """Until no job is live on the new primary, or ``drain_timeout``."""
        assert self.pair is not None
        live: Any = None
        with anyio.move_on_after(self.cfg.drain_timeout):
            while live != 0:
                try:
                    conn = await asyncpg.connect(self.pair.standby.dsn, timeout=5)
                    try:
                        live = await conn.fetchval(common.queries["count_live"], timeout=5)
                    finally:
                        await conn.close()
                except DB_ERRORS:
                    pass
                await anyio.sleep(0.25)
        if live != 0:
            self._note(f"drain timed out after {self.cfg.drain_timeout:.0f} s with {live} live jobs")

    async def _verdict(self, prod: Producer, waiters: Waiters, procs: Processes) -> dict[str, Any]:
        assert self.pair is not None
        conn = await asyncpg.connect(self.pair.standby.dsn, timeout=10)
        try:
            rows = {r["id"]: r for r in await conn.fetch(common.queries["failover_rows"], KIND, timeout=30)}
        finally:
            await conn.close()
        counts = judge(prod.ledger, rows)
        runs = Counter((job_id, n) for job_id, n, _ in read_executions(self.workdir))
        done_after = [r["finished"] for r in rows.values() if r["finished"] and r["finished"] >= self.promoted_at]
        finished = {i: r["finished"] for i, r in rows.items()}
        bad_waiters = waiters.failed(finished)
        if bad_waiters:
            self._note(f"failed waiters: {', '.join(bad_waiters)}")
        return {
            **counts, "reexecuted": sum(1 for c in runs.values() if c > 1), "inflight_at_kill": len(self.inflight),
            "serve_exits": sum(1 for n in procs.exited if n.startswith("serve")),
            "agent_exits": sum(1 for n in procs.exited if n.startswith("agent")),
            "waiters_failed": len(bad_waiters),
            "recovery_s": round(min(done_after) - self.promoted_at, 2) if done_after else None,
            "promote_after_s": round(self.promoted_at - self.fault_at, 2), "enqueued": len(prod.ledger),
            "insert_errors": prod.errors, "waiters": len(waiters.outcomes),
            "waiter_outcomes": dict(Counter(w.outcome for w in waiters.outcomes)),
        }


def judge(ledger: dict[int, dict[str, Any]], rows: dict[int, Any]) -> dict[str, int]:
    """The ledger against the new primary's rows: lost, id mismatches, not done; wrong results of any job."""
    lost = mismatch = not_done = 0
    for job_id, payload in ledger.items():
        row = rows.get(job_id)
        if row is None:
            lost += 1
        elif json.loads(row["payload"]) != payload:
            mismatch += 1
        elif row["status"] != "done":
            not_done += 1
    done = [r for r in rows.values() if r["status"] == "done"]
    wrong = sum(1 for r in done if json.loads(r["result"] or "null") != failover_answer(json.loads(r["payload"])))
    return {"lost": lost, "id_mismatch": mismatch, "not_done": not_done, "wrong": wrong, "done": len(done),
            "retried": sum(1 for r in done if r["attempts"] > 1)}


def failures_of(variant: str, out: dict[str, Any]) -> list[str]:
    """Issue #29's thresholds a must-pass variant broke (none for async: it is measured, not judged)."""
    if variant not in MUST_PASS:
        return []
    bad = [f"{variant}.{k}={out[k]}" for k in ZERO if out.get(k)]
    if out.get("reexecuted", 0) > out.get("inflight_at_kill", 0):
        bad.append(f"{variant}.reexecuted={out['reexecuted']}>inflight_at_kill={out['inflight_at_kill']}")
    if out.get("recovery_s") is None or out["recovery_s"] > RECOVERY_LIMIT_S:
        bad.append(f"{variant}.recovery_s={out.get('recovery_s')}")
    return bad


# -- gpuq bench failover ----------------------------------------------------------


def failed(result: dict[str, Any]) -> list[str]:
    return [b for v, out in result["variants"].items() for b in failures_of(v, out)]


def report(result: dict[str, Any]) -> None:
    extra = ("enqueued", "done", "retried", "insert_errors", "promote_after_s", "sigterm_ignored")
    rows = [[v, *(out.get(k) for k in (*KEYS, *extra))] for v, out in result["variants"].items()]
    common.print_table(["variant", *KEYS, *extra], rows, "gpuq failover (counted from the new primary)")
    for v, out in result["variants"].items():
        print(f"{v}: waiters {out['waiter_outcomes']}")
    print()


def summary(result: dict[str, Any]) -> dict[str, Any]:
    return {"bench": "failover", "variants": {v: {k: out.get(k) for k in (*KEYS, "enqueued", "done",
            "sigterm_ignored")} for v, out in result["variants"].items()}}


def parse_variants(text: str) -> tuple[str, ...]:
    names = tuple(v.strip() for v in text.split(",") if v.strip())
    if not names or set(names) - set(VARIANTS):
        raise argparse.ArgumentTypeError(f"variants are a comma-separated subset of {','.join(VARIANTS)}")
    return names


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--variants", type=parse_variants, default=VARIANTS,
                       help=f"which failures, comma-separated (default {','.join(VARIANTS)})")
        common.positive(p, "--seconds", 20.0, "the producer's window per variant, in seconds")
        common.positive(p, "--rate", 40.0, "jobs enqueued per second")
        common.positive(p, "--fail-at", 0.4, "when the failure comes, as a fraction of --seconds")
        common.positive(p, "--promote-after", 2.0, "seconds from the failure to the standby's promotion")
        common.fleet_args(p, agents=4, capacity=4)
        common.positive(p, "--work-ms", 100.0, "mean handler time per job")
        p.add_argument("--waiters", type=int, default=8, help="gpuq.wait calls across the failure (default 8)")
        common.positive(p, "--wait-timeout", 30.0, "each waiter's own timeout, in seconds")
        common.positive(p, "--drain-timeout", 40.0, "give up waiting for the queue to empty after this long")
        p.add_argument("--seed", type=int, default=None, help="seed of the payloads and handler times")
        p.add_argument("--keep-logs", action="store_true", help="keep process logs even on success")

    async def body(_t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        cfg = FailoverConfig(seconds=a.seconds, fail_at=a.fail_at, promote_after=a.promote_after, rate=a.rate,
                             agents=a.agents, capacity=a.capacity, work_ms=a.work_ms, waiters=a.waiters,
                             wait_timeout=a.wait_timeout, drain_timeout=a.drain_timeout, seed=a.seed,
                             keep_logs=a.keep_logs)
        return {"variants": {v: await FailoverRun(v, cfg).run() for v in a.variants}}

    common.declare(sub, "failover", "a PostgreSQL failover under load (sync, async, read-only fence, black hole), "
                   "counted from the new primary", __doc__, args, body, report, failed, summary, database=False)


if __name__ == "__main__":
    raise SystemExit(common.standalone("failover"))
