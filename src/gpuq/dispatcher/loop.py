"""The dispatcher's one loop: wait for a reason, run a pass, deliver, and the agents' events.

A pass leases plain jobs per group of agents (``groups.py``), then placed jobs
shape by shape (``placing.py``), and pushes each batch to the agents named in
its ``leased_by`` before the next is computed. Every reason to lease arrives
through ``LeaseTrigger``; outcomes, heartbeats and progress are written by their
own parts in the background, so the server's reader never waits on the
database.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator, Iterable
from typing import Any

import anyio

from gpuq import db, logs, metrics, queue
from gpuq.config import ServerConfig
from gpuq.dispatcher.batching import Batching
from gpuq.dispatcher.completer import Completer
from gpuq.dispatcher.fairshare import FairShare
from gpuq.dispatcher.groups import GroupLeases
from gpuq.dispatcher.heartbeats import Heartbeats
from gpuq.dispatcher.placing import Placing
from gpuq.dispatcher.progress import ProgressWriter
from gpuq.dispatcher.quarantine import Quarantine
from gpuq.dispatcher.roster import Roster
from gpuq.dispatcher.sessions import AgentSession, Sessions, group_kinds
from gpuq.dispatcher.spans import ServerSpans
from gpuq.dispatcher.trigger import LeaseTrigger, Pass
from gpuq.dispatcher.tuning import TUNING_DEFAULT, Tuning
from gpuq.jobs import JobBackoff, LeasedJob
from gpuq.latency import JobLatency
from gpuq.loops import Outage, run_every
from gpuq.protocol import CheckpointItem, DeviceFault, Outcome, ProgressUpdate
from gpuq.quarantine import Policy

log = logs.get("dispatcher")


class Dispatcher:
    def __init__(self, pool: Any, config: ServerConfig, tuning: Tuning = TUNING_DEFAULT,
                 backoff: JobBackoff | None = None):
        self.pool, self.config, self.tuning, self.stopping = pool, config, tuning, False
        self.sessions = Sessions()
        self.latency = JobLatency(enabled=False)  # the dashboard turns it on
        self.spans = ServerSpans()  # traced jobs' lease and completion spans (gpuq[otel])
        self.fair_share = FairShare(pool, tuning)  # whether outcomes charge tenants' usage
        self.completer = Completer(pool, backoff or JobBackoff(), on_written=self._outcomes_written, latency=self.latency,
                                   on_released=self._credit_freed, spans=self.spans, charging=lambda: self.fair_share.on)
        self.progress = ProgressWriter(pool, tuning.progress_write_seconds)
        self.heartbeats = Heartbeats(pool, config.lease_seconds, on_lost=self.sessions.cancel_on)
        self.trigger = LeaseTrigger(pool, config, tuning, on_kind=self._announced, on_cancel=self.sessions.cancel_running)
        self.groups = GroupLeases(pool, config, tuning, lambda: self.trigger.listen_pid, self.trigger.recheck,
                                  self.fair_share)
        self.trigger.on_listen = lambda: self.groups.listen_connected(self.trigger.listen_pid or 0)
        self.roster = Roster(pool, tuning, self.sessions)  # this server's agents, for the other servers
        self.placing = Placing(pool, config, tuning, self.roster, self.fair_share)
        self.batching = Batching(pool, config, tuning)
        self.quarantine = Quarantine(pool, Policy(config.quarantine_faults, config.quarantine_window_seconds), self.sessions, self._quarantine_changed, tuning)
        self.trigger.on_quarantine, self.trigger.on_preempt, self._passes = self.quarantine.changed, self.sessions.preempt_running, 0

    @property
    def listening(self) -> bool:
        return self.trigger.listening

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            if self.config.listen_url is not None:  # else poll only (a pooled URL and no direct one)
                tg.start_soon(self.trigger.listen)
            tg.start_soon(self._lease_loop)
            for part in (self.completer, self.progress, self.heartbeats, self.roster, self.quarantine):
                tg.start_soon(part.run)

    # -- agents' events (never waiting on the database, but for a disconnect) --

    async def admit(self, session: AgentSession) -> None:
        """Before ``register``: what placement must know first (its quarantined devices)."""
        await self.quarantine.admit(session)

    def register(self, session: AgentSession) -> None:
        self.sessions.add(session)
        self.roster.put(session)
        log.info("agent.connected", agent=session.id, kinds=sorted(session.kinds), capacity=session.capacity)
        self._credit_freed(session, new_agent=True)

    async def unregister(self, session: AgentSession) -> None:
        """The connection ended: commit what it reported, then return its jobs at once."""
        self.sessions.remove(session)
        self.roster.drop(session)
        self.heartbeats.forget(session.id)
        released: list[int] = []
        # Shielded from the connection's end, bounded by a hung database.
        with anyio.CancelScope(shield=True, deadline=anyio.current_time() + self.tuning.shutdown_db_seconds) as scope:
            try:
                await self.completer.flush()
                moved = await queue.release_agent(self.pool, session.id, session.protocol.ledger.started_ids())
                released = moved.pending + moved.dead
                if moved.dead:
                    log.info("job.dead", agent=session.id, job_ids=moved.dead, count=len(moved.dead),
                             reason="agent disconnected during the last attempt")
            except db.RETRYABLE_ERRORS as exc:
                # Its leases expire instead; the sweeper reclaims them.
                log.warning("agent.release_failed", agent=session.id, error=str(exc))
        if scope.cancelled_caught:
            log.warning("agent.release_failed", agent=session.id, error="the database did not answer in time")
        log.info("agent.disconnected", agent=session.id, released=len(released),
                 inflight=len(session.inflight))
        self.progress.forget(session.inflight)
        self.spans.forget(session.inflight)
        session.inflight.clear()

    def submit(self, session: AgentSession, outcomes: Iterable[tuple[Outcome, str]], freed: int,
               ran: dict[int, float] | None = None) -> None:
        """Queue reported outcomes ``(message, kind)`` for the database; ``freed`` credits came back.

        The session's protocol has already matched them to the jobs it holds;
        an outcome for a job it was not given (kind '?') still goes to the
        database, where the lease token decides, and is acked either way.
        """
        self.completer.submit(session, outcomes, ran)
        if self.progress.latest:
            self.progress.forget(msg.id for msg, _ in outcomes)
        if freed:
            self._credit_freed(session)

    def failed_on(self, session: AgentSession, failed: dict[int, tuple[str, tuple[int, ...]]]) -> None:
        """Failed jobs, by id: (lease token, the devices they held here): their next attempt avoids them."""
        self.completer.failed_on(session.name, failed)

    def device_fault(self, session: AgentSession, fault: DeviceFault) -> None:
        self.quarantine.fault(session, fault)

    def _quarantine_changed(self, session: AgentSession, freed: bool) -> None:
        """Its devices that placement may use changed: the other servers read it; freed ones take work."""
        self.roster.put(session)
        if freed and session.id in self.sessions:
            self._credit_freed(session, new_agent=True)

    def heartbeat(self, session: AgentSession, ids: tuple[int, ...]) -> None:
        self.heartbeats.submit(session.id, ids)

    def released(self, session: AgentSession, jobs: tuple[tuple[int, str], ...]) -> None:
        """Prefetched jobs the agent will not start (the protocol dropped them): pending again."""
        self.completer.release_unstarted(session, jobs)

    def checkpoint(self, session: AgentSession, items: Iterable[CheckpointItem]) -> None:
        """Checkpoints of jobs the connection holds: written, before any later outcome, by the completer."""
        self.completer.submit_checkpoints(session, items)

    def report_progress(self, updates: Iterable[ProgressUpdate]) -> None:
        """Progress of jobs the reporting connection holds: written within ``Tuning.progress_write_seconds``."""
        self.progress.submit(updates)

    def agent_updated(self, session: AgentSession) -> None:
        """Its labels or warm models changed: jobs may now fit it, or fit it better."""
        log.info("agent.updated", agent=session.id, labels=list(session.protocol.labels),
                 models=list(session.protocol.models))
        self.roster.put(session)
        self._credit_freed(session, new_agent=True)

    def agent_draining(self, session: AgentSession) -> None:
        """It finishes what it holds and takes nothing new: no job waits for its warm models."""
        log.info("agent.draining", agent=session.id, inflight=len(session.inflight))
        self.roster.put(session)

    def _credit_freed(self, session: Any, new_agent: bool = False) -> None:
        """Its group may lease again (its key leaves out the kinds it takes only in batches), and so
        may the batched kinds it takes."""
        group = group_kinds(session, self.batching.kinds)
        if new_agent:
            self.groups.agent_came(group)
        self.trigger.credit_freed(group)
        if group != session.kinds:
            self.trigger.credit_freed(session.kinds)

    def _announced(self, kind: str, top: int | None) -> None:
        self.groups.cursors.announced(kind, top)

    def _outcomes_written(self) -> None:
        """Limits the ended jobs held may have room again: shapes and batched kinds that came up
        short while they were full look again."""
        placed = self.placing.outcomes_written()
        if self.batching.outcomes_written(self.placing.may_limit) or placed:
            self.trigger.wake()

    # -- the loop ------------------------------------------------------------

    async def _lease_loop(self) -> None:
        await run_every(0, self._lease_once, errors=db.RETRYABLE_ERRORS, on_error=self._lease_failed,
                        outage=Outage(log, "lease.failed"),
                        until=lambda: self.stopping)

    async def _lease_once(self) -> None:
        """Wait for a reason to lease (a notification, freed credit, a poll), then lease."""
        why = await self.trigger.wait(self.sessions.any_room(), self._wait_left)
        if why is None or self.stopping:
            return
        try:
            await self.lease_pass(why)
        except db.RETRYABLE_ERRORS:
            self.trigger.put_back(why)  # what it was to look at is still to be looked at
            raise

    def _wait_left(self) -> float | None:
        """Seconds until placement, batching or a read of the weights wants a pass of its own (None: never)."""
        any_room = self.sessions.any_room()
        waits = [w for w in (self.placing.wait_left(any_room), self.batching.wait_left(self.sessions) if any_room else None,
                             self.fair_share.wait_left())
                 if w is not None]
        return min(waits) if waits else None

    def _lease_failed(self, exc: BaseException, retry_in: float) -> None:
        self.trigger.lease_failed()

    async def lease_pass(self, why: Pass) -> None:
        """One pass: every batched kind with a reason to lease and every group (taking turns at going
        first, so neither always gets an agent's freed credit), then every shape; each lease
        delivered before the next."""
        stopping = lambda: self.stopping  # noqa: E731
        batched = self.batching.kinds
        if await self.fair_share.refresh(why):  # on or off: every group in the new order, cursors afresh
            why.every = why.rewind = True
        await self.batching.refresh(self.sessions, why)  # the batched kinds, before either leases
        if self.batching.kinds != batched:
            # Groups changed (sessions.group_kinds): a job announced to the old ones, and left
            # waiting there, has no other reason to be looked at before the next poll.
            why.every = True
        plain = [self.batching.lease(self.sessions, why, stopping),
                 self.groups.lease(self.sessions, why, self.listening, stopping, self.batching.kinds)]
        self._passes += 1
        for leases in plain if self._passes % 2 else reversed(plain):
            await self._deliver_all(leases)
        await self._deliver_all(self.placing.lease(self.sessions, why.every, why.kinds, stopping,
                                                   self.batching.policies))

    async def _deliver_all(self, batches: AsyncIterator[list[LeasedJob]]) -> None:
        started = self.spans.lease_started()
        async for jobs in batches:
            if jobs:
                self.trigger.found_work()
            self._deliver(jobs)
            self.spans.leased(jobs, started)
            started = self.spans.lease_started()

    def _deliver(self, jobs: list[LeasedJob]) -> None:
        by_session: dict[str, list[LeasedJob]] = {}
        for j in jobs:
            by_session.setdefault(j.leased_by, []).append(j)
        for kind, n in Counter(j.kind for j in jobs).items():
            metrics.JOBS_LEASED.labels(kind=kind).inc(n)
        metrics.LEASE_BATCH.observe(len(jobs))
        self.latency.leased(jobs)
        debug = logs.debug_enabled()
        for sid, batch in by_session.items():
            session = self.sessions.get(sid)
            if session is None:  # left between the lease and now: give the jobs back
                self.completer.release(j.id for j in batch)
                continue
            if debug:
                for j in batch:
                    log.debug("job.pushed", job_id=j.id, agent=sid, kind=j.kind, attempt=j.attempt)
            if refused := session.protocol.send_jobs(batch):  # never: slots followed its free devices
                log.error("job.no_devices", agent=sid, job_ids=[j.id for j in refused])
                self.completer.release(j.id for j in refused)
            session.flush()
        metrics.INFLIGHT.set(self.sessions.inflight())

    # -- shutdown --------------------------------------------------------------

    async def drain(self, deadline_seconds: float) -> None:
        """Stop leasing, ask agents to finish, wait for their results, release the rest."""
        self.stopping = True
        self.trigger.wake()
        log.info("dispatcher.draining", agents=len(self.sessions), deadline_seconds=deadline_seconds)
        self.sessions.send_drain(deadline_seconds)
        with anyio.move_on_after(deadline_seconds):
            while self.sessions.inflight():
                await anyio.sleep(0.05)
        left = [i for s in self.sessions for i in s.inflight]
        with anyio.move_on_after(self.tuning.shutdown_db_seconds) as scope:
            await self.completer.flush()
            left = [i for s in self.sessions for i in s.inflight]
            if left:
                try:
                    await queue.release_jobs(self.pool, left)
                except db.RETRYABLE_ERRORS as exc:
                    log.warning("dispatcher.release_failed", error=str(exc), count=len(left))
        if scope.cancelled_caught:  # their leases expire; the sweeper gives them back
            log.warning("dispatcher.release_failed", error="the database did not answer in time", count=len(left))
        log.info("dispatcher.drained", released=len(left))

    async def leave(self) -> None:
        """After the agents' connections closed: this server's fleet rows go now (bounded: a hung
        database leaves them to the staleness bound)."""
        with anyio.move_on_after(self.tuning.shutdown_db_seconds):
            try:
                await self.roster.leave()
            except db.RETRYABLE_ERRORS as exc:
                log.warning("fleet.leave_failed", error=str(exc))
