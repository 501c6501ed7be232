"""The dispatcher: LISTEN for new work, lease it for agents with free credit, record outcomes.

It knows agents only as ``AgentSession`` objects (the server creates one per
websocket connection) and queues frames through each one's sans-I/O protocol
object, so the websocket code stays in ``server.py``, the connection's rules in
``protocol/server_side.py`` and the SQL in ``sql/queries.sql``.

Three loops run in one task group:
- ``_listen_loop``: one LISTEN connection on ``gpuq_jobs``, reconnected with
  backoff; each notification only marks kinds as "has work" and wakes the
  lease loop, so a burst of notifications coalesces into a few passes.
- ``_lease_loop``: a pass leases, per group of agents taking the same kinds,
  at most their free credits in one statement (``queue.lease_slots``) and
  pushes each job to the agent named in its ``leased_by``. It wakes on a
  notification, on freed credit, on a new agent, and on a poll timer while
  any agent has free credit: no notification is needed for correctness.
- ``Completer``: results are batched into one ``complete_many`` (and one
  ``fail_many``) per flush and acknowledged to agents only after commit.
"""

from __future__ import annotations

import itertools
import random
import secrets
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import anyio
import asyncpg

from gpuq import db, logs, metrics, queue
from gpuq.config import ServerConfig
from gpuq.protocol import Done, Failed
from gpuq.protocol.server_side import ServerProtocol
from gpuq.queue import Backoff
from gpuq.sql import queries

log = logs.get("dispatcher")


@dataclass(eq=False)
class AgentSession:
    """One connected agent, as the dispatcher sees it.

    Its protocol object holds the connection's rules and credit (the jobs it
    holds); frames queued there go out when ``flush()`` wakes its writer.
    """

    protocol: ServerProtocol
    flush: Callable[[], None]  # wake the connection's writer (never blocks)
    close: Callable[[int, str], Awaitable[None]]
    id: str = ""  # the jobs' leased_by: name + a per-connection suffix
    kinds: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        hello = self.protocol.hello
        assert hello is not None, "a session starts after the hello"
        self.name = hello.agent
        self.kinds = frozenset(hello.kinds)
        if not self.id:
            self.id = f"{self.name}#{secrets.token_hex(4)}"

    @property
    def capacity(self) -> int:
        return self.protocol.capacity

    @property
    def inflight(self) -> dict[int, tuple[str, str]]:
        """Job id -> (lease token, kind) of the jobs pushed and not yet reported."""
        return self.protocol.held

    @property
    def free(self) -> int:
        return self.protocol.free

    @property
    def draining(self) -> bool:
        return self.protocol.draining

    def send_ack(self, accepted: tuple[int, ...], rejected: tuple[int, ...]) -> None:
        self.protocol.send_ack(accepted, rejected)
        self.flush()


class Dispatcher:
    def __init__(self, pool: Any, config: ServerConfig, backoff: Backoff | None = None):
        self.pool = pool
        self.config = config
        self.sessions: dict[str, AgentSession] = {}
        self.completer = Completer(self, backoff or Backoff())
        self.listening = False
        self.stopping = False
        self._wake = anyio.Event()
        self._notified: set[str] = set()  # kinds with new work since the last pass
        self._notified_all = True  # lease for every group (start, reconnect, poll)
        self._credit: set[frozenset[str]] = set()  # groups whose agents freed credit
        self._empty: set[frozenset[str]] = set()  # groups whose last lease came up short
        self._rotation = 0

    # -- agents ----------------------------------------------------------

    def register(self, session: AgentSession) -> None:
        self.sessions[session.id] = session
        metrics.AGENTS.set(len(self.sessions))
        log.info("agent.connected", agent=session.id, kinds=sorted(session.kinds), capacity=session.capacity)
        self._credit_freed(session, new_agent=True)

    async def unregister(self, session: AgentSession) -> None:
        """The connection ended: commit what it reported, then return its jobs at once."""
        self.sessions.pop(session.id, None)
        metrics.AGENTS.set(len(self.sessions))
        with anyio.CancelScope(shield=True):
            released: list[int] = []
            try:
                await self.completer.flush()
                moved = await queue.release_agent(self.pool, session.id)
                released = moved.pending + moved.dead
                if moved.dead:
                    log.info("job.dead", agent=session.id, job_ids=moved.dead, count=len(moved.dead),
                             reason="agent disconnected during the last attempt")
            except db.RETRYABLE_ERRORS as exc:
                # Its leases expire instead; the sweeper reclaims them.
                log.warning("agent.release_failed", agent=session.id, error=str(exc))
        log.info("agent.disconnected", agent=session.id, released=len(released),
                 inflight=len(session.inflight))
        session.inflight.clear()

    def submit(self, session: AgentSession, outcomes: Iterable[tuple[Done | Failed, str]], freed: int) -> None:
        """Queue reported outcomes ``(message, kind)`` for the database; ``freed`` credits came back.

        The session's protocol has already matched them to the jobs it holds;
        an outcome for a job it was not given (kind '?') still goes to the
        database, where the lease token decides, and is acked either way.
        """
        done, failed = self.completer.done, self.completer.failed
        for msg, kind in outcomes:
            if isinstance(msg, Done):
                done.append((session, msg, kind))
            else:
                failed.append((session, msg, kind))
        self.completer.wake()
        if freed:
            self._credit_freed(session)

    def set_draining(self, session: AgentSession) -> None:
        log.info("agent.draining", agent=session.id, inflight=len(session.inflight))

    async def heartbeat(self, session: AgentSession, ids: tuple[int, ...]) -> set[int]:
        return await queue.heartbeat(self.pool, ids, session.id, self.config.lease_seconds)

    def _credit_freed(self, session: AgentSession, new_agent: bool = False) -> None:
        if new_agent:
            self._empty.discard(session.kinds)
        self._credit.add(session.kinds)
        self._wake.set()

    # -- notifications ---------------------------------------------------

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        metrics.NOTIFICATIONS.inc()
        if payload == "*" or not payload:
            self._notified_all = True
        else:
            self._notified.update(payload.split(","))
        self._wake.set()

    def wake_all(self) -> None:
        self._notified_all = True
        self._wake.set()

    # -- loops -----------------------------------------------------------

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._listen_loop)
            tg.start_soon(self._lease_loop)
            tg.start_soon(self.completer.run)

    async def _listen_loop(self) -> None:
        delay = 0.1
        while True:
            conn = None
            try:
                conn = await db.connect(self.config.database_url)
                lost = anyio.Event()
                conn.add_termination_listener(lambda _c, lost=lost: lost.set())
                await conn.add_listener(queue.NOTIFY_CHANNEL, self._on_notify)
                self.listening, delay = True, 0.1
                log.info("listen.connected", channel=queue.NOTIFY_CHANNEL)
                self.wake_all()  # anything inserted while we were not listening
                while not lost.is_set():
                    with anyio.move_on_after(5):
                        await lost.wait()
                    if not lost.is_set():
                        await conn.execute(queries["ping"], timeout=5)  # catch a half-open socket
            except db.RETRYABLE_ERRORS as exc:
                log.warning("listen.lost", error=str(exc), retry_in=round(delay, 2))
            finally:
                self.listening = False
                if conn is not None and not conn.is_closed():
                    conn.terminate()
            await anyio.sleep(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, 5.0)

    async def _lease_loop(self) -> None:
        delay = 0.05
        while not self.stopping:
            if not self._wake.is_set():
                poll = self.config.poll_seconds if self._any_free() else None
                with anyio.move_on_after(poll) as scope:
                    await self._wake.wait()
                if scope.cancelled_caught:
                    self._notified_all = True  # poll: look at every group
            self._wake = anyio.Event()  # wakes during the pass trigger another pass
            if self.stopping:
                break
            try:
                await self._lease_pass()
                delay = 0.05
            except db.RETRYABLE_ERRORS as exc:
                log.warning("lease.failed", error=str(exc), retry_in=round(delay, 2))
                self._notified_all = True
                await anyio.sleep(delay)
                delay = min(delay * 2, 5.0)

    def _any_free(self) -> bool:
        return any(s.free for s in self.sessions.values())

    async def _lease_pass(self) -> None:
        notified, self._notified = self._notified, set()
        notified_all, self._notified_all = self._notified_all, False
        credit, self._credit = self._credit, set()
        groups: dict[frozenset[str], list[AgentSession]] = {}
        for s in self.sessions.values():
            if s.free:
                groups.setdefault(s.kinds, []).append(s)
        order = list(groups.items())
        self._rotation += 1
        if order:  # rotate so no group always goes first
            k = self._rotation % len(order)
            order = order[k:] + order[:k]
        for kinds, members in order:
            if notified_all or kinds & notified:
                self._empty.discard(kinds)
            elif kinds not in credit or kinds in self._empty:
                continue
            await self._lease_group(kinds, members)

    async def _lease_group(self, kinds: frozenset[str], members: list[AgentSession]) -> None:
        """Lease for one group until its credit is used or the queue has no more for it."""
        while not self.stopping:
            slots = _interleave(members, self.config.max_batch)
            if not slots:
                return
            with metrics.LEASE_SECONDS.time():
                result = await queue.lease_slots(self.pool, sorted(kinds), slots, self.config.lease_seconds)
            self._deliver(result.jobs)
            if result.jobs or result.dead:
                log.info("lease.batch", batch=len(result.jobs), requested=len(slots), kinds=sorted(kinds),
                         agents=len({j.leased_by for j in result.jobs}), reclaimed=result.reclaimed,
                         dead=result.dead)
            if len(result.jobs) < len(slots):
                self._empty.add(kinds)
                return

    def _deliver(self, jobs: list[queue.LeasedJob]) -> None:
        by_session: dict[str, list[queue.LeasedJob]] = {}
        for j in jobs:
            by_session.setdefault(j.leased_by, []).append(j)
        for kind, n in Counter(j.kind for j in jobs).items():
            metrics.JOBS_LEASED.labels(kind=kind).inc(n)
        metrics.LEASE_BATCH.observe(len(jobs))
        debug = logs.debug_enabled()
        for sid, batch in by_session.items():
            session = self.sessions.get(sid)
            if session is None:  # left between the lease and now: give the jobs back
                self.completer.orphans.extend(j.id for j in batch)
                self.completer.wake()
                continue
            if debug:
                for j in batch:
                    log.debug("job.pushed", job_id=j.id, agent=sid, kind=j.kind, attempt=j.attempt)
            session.protocol.send_jobs(batch)
            session.flush()
        metrics.INFLIGHT.set(sum(len(s.inflight) for s in self.sessions.values()))

    # -- shutdown --------------------------------------------------------

    async def drain(self, deadline_seconds: float) -> None:
        """Stop leasing, ask agents to finish, wait for their results, release the rest."""
        self.stopping = True
        self._wake.set()
        log.info("dispatcher.draining", agents=len(self.sessions), deadline_seconds=deadline_seconds)
        for s in list(self.sessions.values()):
            s.protocol.send_drain(deadline_seconds)
            s.flush()
        with anyio.move_on_after(deadline_seconds):
            while any(s.inflight for s in self.sessions.values()):
                await anyio.sleep(0.05)
        await self.completer.flush()
        left = [i for s in self.sessions.values() for i in s.inflight]
        if left:
            try:
                await queue.release_jobs(self.pool, left)
            except db.RETRYABLE_ERRORS as exc:
                log.warning("dispatcher.release_failed", error=str(exc), count=len(left))
        log.info("dispatcher.drained", released=len(left))


def _interleave(members: list[AgentSession], limit: int) -> list[str]:
    """Each agent once per free credit, round-robin, at most ``limit`` slots."""
    random.shuffle(members)  # fairness among agents when there are fewer jobs than slots
    columns = [[s.id] * s.free for s in members]
    slots = [sid for row in itertools.zip_longest(*columns) for sid in row if sid is not None]
    return slots[:limit]


class Completer:
    """Batches agents' outcomes into few statements; acks each agent after commit."""

    def __init__(self, dispatcher: Dispatcher, backoff: Backoff):
        self.d = dispatcher
        self.backoff = backoff
        # Outcomes waiting for the database, appended by Dispatcher.submit (then wake()).
        self.done: list[tuple[AgentSession, Done, str]] = []
        self.failed: list[tuple[AgentSession, Failed, str]] = []
        self.orphans: list[int] = []  # leased for an agent that left before the push
        self._wake = anyio.Event()
        self._lock = anyio.Lock()

    def wake(self) -> None:
        self._wake.set()

    async def run(self) -> None:
        delay = 0.05
        while True:
            await self._wake.wait()
            self._wake = anyio.Event()
            try:
                await self.flush()
                delay = 0.05
            except db.RETRYABLE_ERRORS as exc:
                # Nothing is dropped: the outcomes stay queued and the agents
                # un-acked until the database takes them.
                log.warning("results.flush_failed", error=str(exc), retry_in=round(delay, 2))
                await anyio.sleep(delay)
                delay = min(delay * 2, 5.0)
                self._wake.set()

    async def flush(self) -> None:
        async with self._lock:
            while self.done or self.failed or self.orphans:
                try:
                    await self._flush_once()
                except asyncpg.DataError:
                    # One outcome the database refuses must not block the batch
                    # forever: write them one by one and refuse the bad ones.
                    await self._flush_singly()

    async def _flush_singly(self) -> None:
        done, failed = self.done[:1000], self.failed[:1000]
        del self.done[:len(done)], self.failed[:len(failed)]
        for outcome in done:
            self.done.append(outcome)
            await self._flush_or_refuse(outcome, self.done)
        for failure in failed:
            self.failed.append(failure)
            await self._flush_or_refuse(failure, self.failed)

    async def _flush_or_refuse(self, item: Any, pending: list[Any]) -> None:
        try:
            await self._flush_once()
        except asyncpg.DataError as exc:
            pending.remove(item)
            session, msg, _kind = item
            log.error("job.outcome_refused", job_id=msg.id, agent=session.id, error=str(exc))
            metrics.RESULTS_REJECTED.inc()
            session.send_ack((), (msg.id,))

    async def _flush_once(self) -> None:
        done, failed, orphans = self.done[:1000], self.failed[:1000], self.orphans[:1000]
        accepted: set[int] = set()
        outcomes: dict[int, queue.FailOutcome] = {}
        if done:
            accepted = await queue.complete_many(self.d.pool, [(m.id, m.lease_token, m.result) for _, m, _ in done])
        if failed:
            outcomes = await queue.fail_many(
                self.d.pool, [(m.id, m.lease_token, m.error, m.retryable) for _, m, _ in failed], self.backoff)
        if orphans:
            await queue.release_jobs(self.d.pool, orphans)
        # Committed: now take them off the queue and tell the agents.
        del self.done[:len(done)], self.failed[:len(failed)], self.orphans[:len(orphans)]
        acks: dict[AgentSession, tuple[list[int], list[int]]] = {}
        done_kinds: Counter[str | None] = Counter()
        for session, m, kind in done:
            ok = m.id in accepted
            acks.setdefault(session, ([], []))[0 if ok else 1].append(m.id)
            done_kinds[kind if ok else None] += 1
        for done_kind, n in done_kinds.items():
            if done_kind is None:
                metrics.RESULTS_REJECTED.inc(n)
            else:
                metrics.JOBS_DONE.labels(kind=done_kind).inc(n)
        for session, f, kind in failed:
            out = outcomes.get(f.id)
            acks.setdefault(session, ([], []))[0 if out else 1].append(f.id)
            if out:
                metrics.JOBS_FAILED.labels(kind=kind, outcome=out.status).inc()
            else:
                metrics.RESULTS_REJECTED.inc()
        for session, (ok_ids, bad_ids) in acks.items():
            session.send_ack(tuple(ok_ids), tuple(bad_ids))
        self._log(done, failed, accepted, outcomes)

    def _log(self, done: list[Any], failed: list[Any], accepted: set[int],
             outcomes: dict[int, queue.FailOutcome]) -> None:
        if done:
            rejected = [m.id for _, m, _ in done if m.id not in accepted]
            log.info("job.done", count=len(accepted), job_ids=sorted(accepted),
                     agents=sorted({s.id for s, _, _ in done}))
            if rejected:
                log.warning("job.rejected", count=len(rejected), job_ids=rejected,
                            reason="stale lease token (the lease was reclaimed or the job finished)")
        for session, m, kind in failed:
            out = outcomes.get(m.id)
            if out is None:
                log.warning("job.rejected", job_id=m.id, agent=session.id, kind=kind, reason="stale lease token")
            else:
                event = "job.dead" if out.status == "dead" else "job.failed"
                log.info(event, job_id=m.id, agent=session.id, kind=kind, retryable=m.retryable,
                         run_at=out.run_at.isoformat() if out.status == "scheduled" else None,
                         error=m.error[:200])
