"""The completer: agents' outcomes, batched into few statements and acked after commit.

``submit`` queues outcomes as the server reads them; one task writes every
outcome queued by then with one ``complete_many`` and one ``fail_many``, then
acks each agent. While fair share is on (``charging``) their ``_charged``
variants also charge each attempt's GPU-seconds to its tenant, in the same
statement; off, nothing more is written. Jobs that yielded to a preempt
(``Preempted``, protocol 9) go back to pending, fenced the same way, in the
same flush (``preempted_many``). Jobs given back unstarted (``release_unstarted``) and leases
no agent will run (``release``) go back to pending in the same flush. Checkpoints
(protocol 9) are written first in each flush, fenced like outcomes, and answered
(``checkpointed``) after their commit: a job's checkpoint, which its agent sends
before its outcome (or release), is thus always written before that ends the lease. A batch
the database refuses (a value jsonb cannot take) is written one by one, so one
bad outcome cannot block the others.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import anyio
import asyncpg

from gpuq import logs, metrics, preemptions, quarantine, queue
from gpuq.dispatcher.spans import ServerSpans
from gpuq.dispatcher.writer import Writer
from gpuq.jobs import FailOutcome, JobBackoff
from gpuq.latency import JobLatency
from gpuq.protocol import CheckpointItem, Done, Failed, Outcome, Preempted
from gpuq.protocol.fields import to_json

log = logs.get("completer")


class Session(Protocol):
    """What the completer needs of an agent's connection."""

    id: str

    def send_ack(self, accepted: tuple[int, ...], rejected: tuple[int, ...]) -> None: ...

    def send_checkpointed(self, stored: tuple[int, ...], refused: tuple[int, ...]) -> None: ...


class Completer(Writer):
    """Batches agents' outcomes into few statements; acks each agent after commit.

    Nothing is dropped on a failure: the outcomes stay queued and the agents
    un-acked until the database takes them.
    """

    component = "completer"
    failed_event = "results.flush_failed"

    def __init__(self, pool: Any, backoff: JobBackoff, on_written: Callable[[], None] | None = None,
                 latency: JobLatency | None = None, on_released: Callable[[Session], None] | None = None,
                 spans: ServerSpans | None = None, charging: Callable[[], bool] = lambda: False):
        super().__init__()
        self.pool = pool
        self.backoff = backoff
        self.charging = charging  # is fair share on? Then outcomes charge their tenants' usage
        self.on_written = on_written  # after each commit of outcomes (limits may have room again)
        self.on_released = on_released  # after an agent's unstarted jobs are pending again
        self.latency = latency  # told which jobs ended (completion latency)
        self.spans = spans  # told which outcomes were written, and when (traced jobs' completion spans)
        # Outcomes waiting for the database (add them with submit(), release()).
        self.done: list[tuple[Session, Done, str]] = []
        self.failed: list[tuple[Session, Failed, str]] = []
        self.preempted: list[tuple[Session, Preempted, str]] = []
        self.orphans: list[int] = []  # leased for an agent that left before the push
        self.unstarted: list[tuple[Session, tuple[tuple[int, str], ...]]] = []  # given back, (id, token)
        self.failed_devices: list[tuple[int, str, tuple[str, ...]]] = []  # (id, token, 'agent:index'...) failed there
        self.ran: dict[int, float] = {}  # job id -> its handler's run time, where the agent told its start
        self.checkpoints: list[tuple[Session, CheckpointItem]] = []  # in the order they came
        self._lock = anyio.Lock()

    def submit(self, session: Session, outcomes: Iterable[tuple[Outcome, str]],
               ran: dict[int, float] | None = None) -> None:
        """Queue ``(outcome, kind)`` pairs reported by ``session``; acked after the commit. ``ran``:
        the run times the protocol measured (fair share charges them, else the lease's age)."""
        if ran:
            self.ran.update(ran)
        for msg, kind in outcomes:
            if isinstance(msg, Done):
                self.done.append((session, msg, kind))
            elif isinstance(msg, Failed):
                self.failed.append((session, msg, kind))
            else:
                self.preempted.append((session, msg, kind))
        self.wake()

    def failed_on(self, agent: str, failed: dict[int, tuple[str, tuple[int, ...]]]) -> None:
        """Failed jobs held with devices of agent ``agent`` (its name), by id: (lease token, devices).
        Written before their outcome, in the same flush: their next lease avoids those devices."""
        self.failed_devices.extend((i, token, tuple(quarantine.device_name(agent, d) for d in devices))
                                   for i, (token, devices) in failed.items())

    def submit_checkpoints(self, session: Session, items: Iterable[CheckpointItem]) -> None:
        """Queue checkpoints of jobs ``session`` holds; answered after the commit."""
        self.checkpoints.extend((session, item) for item in items)
        self.wake()

    def release(self, ids: Iterable[int]) -> None:
        """Give back leases that no agent will run (their agent left before the push)."""
        self.orphans.extend(ids)
        self.wake()

    def release_unstarted(self, session: Session, jobs: tuple[tuple[int, str], ...]) -> None:
        """The agent gave back prefetched jobs it will not start: pending again, their attempt not
        counted (if the database is away, they wait here; their leases may expire first)."""
        self.unstarted.append((session, jobs))
        self.wake()

    async def write(self) -> None:
        await self.flush()

    async def flush(self) -> None:
        async with self._lock:
            while self.done or self.failed or self.orphans or self.unstarted or self.preempted or self.checkpoints:
                try:
                    await self._flush_once()
                except asyncpg.DataError as exc:
                    # One outcome the database refuses must not block the batch
                    # forever: write them one by one and refuse the bad ones.
                    if not (self.done or self.failed):
                        self._drop_releases(exc)  # never: ids and tokens are the server's own
                    await self._flush_singly()

    def _drop_releases(self, exc: BaseException) -> None:
        """Releases the database refuses are given up (their leases expire instead), not retried forever."""
        ids = [*self.orphans, *(i for _, jobs in self.unstarted for i, _ in jobs), *(m.id for _, m, _ in self.preempted)]
        log.error("jobs.release_refused", job_ids=ids, error=str(exc))
        self.orphans.clear()
        self.unstarted.clear()
        self.preempted.clear()

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
            self.ran.pop(msg.id, None)  # never written: its run time goes with it
            log.error("job.outcome_refused", job_id=msg.id, agent=session.id, error=str(exc))
            metrics.RESULTS_REJECTED.inc()
            session.send_ack((), (msg.id,))

    async def _flush_once(self) -> None:
        # All taken at once, before any write, and the checkpoints written first: a job's
        # checkpoint came before its outcome or release, so it is written while the lease holds.
        checkpoints, self.checkpoints = self.checkpoints, []
        given, yielded = self.unstarted[:100], self.preempted[:1000]
        done, failed, orphans = self.done[:1000], self.failed[:1000], self.orphans[:1000]
        if checkpoints:
            try:
                await self._write_checkpoints(checkpoints)
            except BaseException:
                self.checkpoints[:0] = checkpoints  # kept, first, for the next try
                raise
        if given:  # its own commit: done and failed are retried without it
            await self._release_unstarted(given)
            del self.unstarted[:len(given)]
        if yielded:  # its own commit too, after the checkpoints (a yield ends the lease)
            await self._write_preempted(yielded)
            del self.preempted[:len(yielded)]
        started = self.spans.write_started() if self.spans is not None else 0
        accepted, outcomes = await self._write_outcomes(done, failed)
        if orphans:
            await queue.release_jobs(self.pool, orphans, undelivered=True)
        # Committed: now take them off the queue and tell the agents.
        del self.done[:len(done)], self.failed[:len(failed)], self.orphans[:len(orphans)]
        if self.on_written is not None:
            self.on_written()
        if self.latency is not None:
            self.latency.finished(accepted, outcomes)
        if self.spans is not None and started:
            self.spans.finished(started, (m for _, m, _ in done), (f for _, f, _ in failed), accepted, outcomes)
        acks: dict[Session, tuple[list[int], list[int]]] = {}
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

    async def _write_preempted(self, yielded: list[tuple[Session, Preempted, str]]) -> None:
        """Jobs that yielded: pending again where their token holds, each agent acked."""
        moved = await preemptions.preempted_many(self.pool, [(m.id, m.lease_token) for _, m, _ in yielded])
        back = {*moved.pending, *moved.dead}
        acks: dict[Session, tuple[list[int], list[int]]] = {}
        for session, m, _kind in yielded:
            acks.setdefault(session, ([], []))[0 if m.id in back else 1].append(m.id)
        for session, (ok_ids, bad_ids) in acks.items():
            if ok_ids:
                log.info("job.preempted", agent=session.id, job_ids=ok_ids, count=len(ok_ids))
            if bad_ids:
                log.warning("job.rejected", agent=session.id, job_ids=bad_ids, reason="stale lease token")
                metrics.RESULTS_REJECTED.inc(len(bad_ids))
            session.send_ack(tuple(ok_ids), tuple(bad_ids))

    async def _write_checkpoints(self, checkpoints: list[tuple[Session, CheckpointItem]]) -> None:
        """Store each job's latest checkpoint (an earlier one of the same job in the batch is
        answered as the latest is: it was replaced), then answer each agent."""
        latest = {item.id: item for _, item in checkpoints}  # the last of each job wins
        try:
            stored = await queue.record_checkpoints(self.pool, [(c.id, c.lease_token, to_json(c.data))
                                                                for c in latest.values()])
        except asyncpg.DataError as exc:  # never: the parser checked the data as the agent did
            log.error("checkpoint.refused", job_ids=sorted(latest), error=str(exc))
            stored = set()
        answers: dict[Session, tuple[list[int], list[int]]] = {}
        for session, item in checkpoints:
            ok = item.id in stored and latest[item.id].lease_token == item.lease_token
            answers.setdefault(session, ([], []))[0 if ok else 1].append(item.seq)
        for session, (ok_seqs, bad_seqs) in answers.items():
            session.send_checkpointed(tuple(ok_seqs), tuple(bad_seqs))
        metrics.CHECKPOINTS_WRITTEN.inc(len(stored))
        if refused := [i for i in latest if i not in stored]:
            log.warning("checkpoint.rejected", job_ids=refused, count=len(refused),
                        reason="stale lease token (the lease was reclaimed or the job finished)")

    async def _write_outcomes(self, done: list[tuple[Session, Done, str]],
                              failed: list[tuple[Session, Failed, str]]) -> tuple[set[int], dict[int, FailOutcome]]:
        """Write outcomes: the ids done accepted, and each accepted failure's outcome. While fair share
        is on, each attempt charges its run time as the protocol measured it (else its lease's age)."""
        accepted: set[int] = set()
        outcomes: dict[int, FailOutcome] = {}
        charge, ran = self.charging(), self.ran
        if done:
            accepted = await queue.complete_many(self.pool, [(m.id, m.lease_token, m.result) for _, m, _ in done],
                                                 charge, [ran.get(m.id) for _, m, _ in done] if charge else None)
        if failed and (on := list(self.failed_devices)):  # before the outcome ends the lease
            await quarantine.record_failed_devices(self.pool, on)
            del self.failed_devices[:len(on)]
        if failed:
            outcomes = await queue.fail_many(
                self.pool, [(m.id, m.lease_token, m.error, m.retryable) for _, m, _ in failed], self.backoff, charge,
                [ran.get(m.id) for _, m, _ in failed] if charge else None)
        for _, m, _ in (*done, *failed) if ran else ():
            ran.pop(m.id, None)
        return accepted, outcomes

    async def _release_unstarted(self, given: list[tuple[Session, tuple[tuple[int, str], ...]]]) -> None:
        moved = await queue.release_unstarted(self.pool, [job for _, jobs in given for job in jobs])
        back = set(moved.pending)
        for session, jobs in given:
            log.info("jobs.released", agent=session.id, job_ids=[i for i, _ in jobs if i in back],
                     count=sum(i in back for i, _ in jobs))
            if self.on_released is not None:
                self.on_released(session)

    def _log(self, done: list[Any], failed: list[Any], accepted: set[int],
             outcomes: dict[int, FailOutcome]) -> None:
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
