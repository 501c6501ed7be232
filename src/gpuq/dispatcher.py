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
  While passes keep finding work it polls every ``busy_poll_seconds`` and
  producers do not NOTIFY; before it waits it arms the wake-up mark, the
  handshake in docs/design.md ("Wake-ups") that makes a lost wake-up
  impossible.
- ``Completer`` (completer.py): results are batched into one ``complete_many``
  (and one ``fail_many``) per flush and acknowledged to agents only after commit.
- ``ProgressWriter`` (progress.py): running jobs' progress, at most one write
  per job per second, many jobs per statement.
"""

from __future__ import annotations

import itertools
import random
import secrets
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import anyio

from gpuq import admin, db, logs, metrics, placement, queue, wakeups
from gpuq.completer import Completer
from gpuq.config import ServerConfig
from gpuq.jobs import JobBackoff, LeasedJob, Shape
from gpuq.latency import JobLatency
from gpuq.loops import LoopBackoff, run_every
from gpuq.progress import ProgressWriter
from gpuq.protocol import Device, Done, Failed, ProgressUpdate
from gpuq.protocol.server_side import ServerProtocol
from gpuq.sql import queries

log = logs.get("dispatcher")

# How long one arm of the wake-up mark asks producers to NOTIFY; an idle
# dispatcher arms again when half of it is left. Also how long producers keep
# notifying after every dispatcher got busy: 1 s cost them 10 % of their commits.
WAKE_MARK_MS = 100
# How often a dispatcher that found stragglers checks whether they have ended.
STRAGGLER_POLL_SECONDS = 0.001
# Cursors start from the top again every this many polls: what no notification
# announces (rows another lease skipped while locked, a job inserted above a
# floor while the floor moved) waits at most this long. Poll-only: every poll.
REWIND_POLLS = 10
# How often the dispatcher looks for a newer settled id (docs/design.md, "Lease cursors").
SETTLE_SECONDS = 0.01
# How often, at most, it reads gpuq.shapes for placement classes new since the last read.
SHAPES_SECONDS = 0.05
# How often it asks how long each multi-GPU shape's next job has waited (for reservations).
RESERVE_CHECK_SECONDS = 1.0


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
    remote: str = ""  # the peer's address

    def __post_init__(self) -> None:
        hello = self.protocol.hello
        assert hello is not None, "a session starts after the hello"
        self.name = hello.agent
        self.kinds = frozenset(hello.kinds)
        if not self.id:
            self.id = f"{self.name}#{secrets.token_hex(4)}"

    @property
    def capacity(self) -> int:
        return self.protocol.ledger.capacity

    @property
    def inflight(self) -> dict[int, tuple[str, str]]:
        """Job id -> (lease token, kind) of the jobs pushed and not yet reported."""
        return self.protocol.ledger.held

    @property
    def free(self) -> int:
        return self.protocol.ledger.free

    @property
    def devices(self) -> tuple[Device, ...]:
        """The GPUs the agent offers (protocol 4; none before)."""
        return self.protocol.hello.devices if self.protocol.hello else ()

    @property
    def version(self) -> int:
        return self.protocol.version

    @property
    def labels(self) -> frozenset[str]:
        return frozenset(self.protocol.labels)

    @property
    def models(self) -> frozenset[str]:
        return frozenset(self.protocol.models)

    def free_devices(self, min_memory_mb: int = 0) -> list[int]:
        return self.protocol.ledger.free_devices(min_memory_mb)

    def ready_devices(self, min_memory_mb: int = 0) -> list[int]:
        return self.protocol.ledger.ready_devices(min_memory_mb)

    @property
    def draining(self) -> bool:
        return self.protocol.draining

    def send_ack(self, accepted: tuple[int, ...], rejected: tuple[int, ...]) -> None:
        self.protocol.send_ack(accepted, rejected)
        self.flush()


class Dispatcher:
    def __init__(self, pool: Any, config: ServerConfig, backoff: JobBackoff | None = None):
        self.pool = pool
        self.config = config
        self.sessions: dict[str, AgentSession] = {}
        self.latency = JobLatency(enabled=False)  # the dashboard turns it on
        self.completer = Completer(pool, backoff or JobBackoff(), on_written=self._outcomes_written,
                                   latency=self.latency)
        self.progress = ProgressWriter(pool)
        self.listening = False
        self.stopping = False
        self._wake = anyio.Event()
        self._notified: set[str] = set()  # kinds with new work since the last pass
        self._notified_all = True  # lease for every group (start, reconnect, poll)
        self._rewind_all = True  # drop every cursor before the next pass (start, reconnect, '*')
        # Polling mode: jobs found since the last poll, or by it. Polls every busy_poll_seconds;
        # the wake-up mark is not renewed, so producers stop notifying. Ends at a poll that finds none.
        self._busy = False
        self._polled_at = 0.0  # monotonic time of the last pass over every group
        # The wake-up handshake (docs/design.md, "Wake-ups").
        self._listen_pid: int | None = None  # our LISTEN connection's backend pid
        self._mark_seen = 0  # the mark (server ms) our last arm left; 0: none to rely on
        self._arm_at = 0.0  # monotonic: arm again from here on
        self._stragglers: list[str] = []  # transactions to see end before the owed pass
        self._owe_pass = False  # a pass over every group is due once the stragglers end
        self._floors: dict[str, int] = {}  # kind -> priority recorded in gpuq.lease_floors
        # Floors lowered (or new): kinds to start from the top once these writers have ended.
        self._confirm: list[tuple[set[str], list[str]]] = []
        self._credit: set[frozenset[str]] = set()  # groups whose agents freed credit
        self._empty: set[frozenset[str]] = set()  # groups whose last lease came up short
        self._rotation = 0
        # kind -> (priority, id) where its next lease starts (docs/design.md, "Lease cursors").
        # Dropped when jobs may be behind it: a notification says so, or poll_seconds passed.
        self._cursors: dict[str, tuple[int, int]] = {}
        self._cursors_since = time.monotonic()
        self._rewinds = 0  # cursors dropped by notifications so far
        # Every job id up to _settled committed or rolled back: cursors may pass it.
        # _horizon: a newer candidate, settled once its writers have ended.
        self._settled = 0
        self._horizon: tuple[int, list[str]] | None = None
        self._settle_at = 0.0
        # Placement (placement.py): the shapes enqueued so far, and those whose last lease came up short.
        self._shapes: dict[tuple[str, str], Shape] = {}
        self._shapes_at, self._shapes_stale = -SHAPES_SECONDS, True
        self._placed_empty: set[tuple[str, str]] = set()
        # Limits (gpuq.limits, read with the shapes): kinds with one, and whether any key has one.
        self._limited_kinds: frozenset[str] = frozenset()
        self._key_limits = False
        self.reserved: dict[str, tuple[str, str]] = {}  # agent id -> the multi-GPU shape it is kept for
        self._reserve_at = 0.0
        self._cold_at: dict[tuple[str, str], float] = {}  # shape -> when its next job may go to a cold agent

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
                moved = await queue.release_agent(self.pool, session.id, session.protocol.ledger.started_ids())
                released = moved.pending + moved.dead
                if moved.dead:
                    log.info("job.dead", agent=session.id, job_ids=moved.dead, count=len(moved.dead),
                             reason="agent disconnected during the last attempt")
            except db.RETRYABLE_ERRORS as exc:
                # Its leases expire instead; the sweeper reclaims them.
                log.warning("agent.release_failed", agent=session.id, error=str(exc))
        log.info("agent.disconnected", agent=session.id, released=len(released),
                 inflight=len(session.inflight))
        self.progress.forget(session.inflight)
        session.inflight.clear()

    async def released(self, session: AgentSession, jobs: tuple[tuple[int, str], ...]) -> None:
        """The agent gave back prefetched jobs it will not start: pending again at once, their attempt
        not counted (if the database is away, their leases expire instead). The protocol dropped them."""
        try:
            moved = await queue.release_unstarted(self.pool, jobs)
        except db.RETRYABLE_ERRORS as exc:
            log.warning("agent.release_failed", agent=session.id, error=str(exc))
            return
        log.info("jobs.released", agent=session.id, job_ids=moved.pending, count=len(moved.pending))
        self._credit_freed(session)

    def submit(self, session: AgentSession, outcomes: Iterable[tuple[Done | Failed, str]], freed: int) -> None:
        """Queue reported outcomes ``(message, kind)`` for the database; ``freed`` credits came back.

        The session's protocol has already matched them to the jobs it holds;
        an outcome for a job it was not given (kind '?') still goes to the
        database, where the lease token decides, and is acked either way.
        """
        self.completer.submit(session, outcomes)
        if self.progress.latest:
            self.progress.forget(msg.id for msg, _ in outcomes)
        if freed:
            self._credit_freed(session)

    def report_progress(self, updates: Iterable[ProgressUpdate]) -> None:
        """Progress of jobs the reporting connection holds: written within ``progress.WRITE_SECONDS``."""
        self.progress.submit(updates)

    def agent_updated(self, session: AgentSession) -> None:
        """Its labels or warm models changed: jobs may now fit it, or fit it better."""
        log.info("agent.updated", agent=session.id, labels=list(session.protocol.labels),
                 models=list(session.protocol.models))
        self._credit_freed(session, new_agent=True)

    def set_draining(self, session: AgentSession) -> None:
        log.info("agent.draining", agent=session.id, inflight=len(session.inflight))

    async def heartbeat(self, session: AgentSession, ids: tuple[int, ...]) -> set[int]:
        """Extend the leases; a job whose lease is gone (cancelled, or reclaimed) is cancelled on
        the agent too: this reaches it even when no notification can (poll-only behind a pooler)."""
        extended = await queue.heartbeat(self.pool, ids, session.id, self.config.lease_seconds)
        if lost := [i for i in ids if i not in extended]:
            self._cancel_running(lost)
        return extended

    def _credit_freed(self, session: AgentSession, new_agent: bool = False) -> None:
        if new_agent:
            self._empty.discard(session.kinds)
        self._credit.add(session.kinds)
        self._wake.set()

    # -- notifications ---------------------------------------------------

    def _on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        metrics.NOTIFICATIONS.inc()
        if payload.startswith(wakeups.CANCEL_PREFIX):
            self._cancel_running(wakeups.parse_cancel(payload))
            return
        wakeup = wakeups.parse_wakeup(payload)
        if wakeup.every:
            self.wake_all(rewind=wakeup.rewind)
        for kind, top in wakeup.kinds.items():
            self._notified.add(kind)
            cursor = self._cursors.get(kind)
            if top is None or (cursor is not None and top > cursor[0]):
                self._cursors.pop(kind, None)  # jobs behind it: start that kind from the top
                self._rewinds += 1
        self._wake.set()

    def _cancel_running(self, ids: list[int]) -> None:
        """Jobs cancelled while leased: the agents holding them are told to stop their handlers."""
        for session in self.sessions.values():
            if told := session.protocol.cancel(ids):
                session.flush()
                log.info("job.cancel_sent", agent=session.id, job_ids=told)

    def wake_all(self, rewind: bool = False) -> None:
        """Lease for every group on the next pass; ``rewind``: from the top of every kind."""
        self._notified_all = True
        self._rewind_all = self._rewind_all or rewind
        self._wake.set()

    # -- loops -----------------------------------------------------------

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            if self.config.listen_url is not None:  # else poll only (a pooled URL and no direct one)
                tg.start_soon(self._listen_loop)
            tg.start_soon(self._lease_loop)
            tg.start_soon(self.completer.run)
            tg.start_soon(self.progress.run)

    async def _listen_loop(self) -> None:
        await run_every(0.1, self._listen_once, backoff=LoopBackoff(first=0.1), errors=db.RETRYABLE_ERRORS,
                        on_error=lambda exc, retry_in: log.warning("listen.lost", error=str(exc), retry_in=retry_in))

    async def _listen_once(self) -> None:
        """Hold one LISTEN connection until it is lost."""
        conn = None
        try:
            assert self.config.listen_url is not None
            conn = await db.connect(self.config.listen_url, direct=True)  # LISTEN needs a session
            lost = anyio.Event()
            conn.add_termination_listener(lambda _c, lost=lost: lost.set())
            await conn.add_listener(wakeups.NOTIFY_CHANNEL, self._on_notify)
            self._listen_pid = conn.get_server_pid()
            await wakeups.clear_floors(self.pool, self._listen_pid)  # ours from before, and the dead's
            self._floors.clear()
            self._confirm.clear()
            self._mark_seen, self._arm_at = 0, 0.0  # notifications were lost: a full handshake
            self.listening = True
            log.info("listen.connected", channel=wakeups.NOTIFY_CHANNEL)
            self.wake_all(rewind=True)  # anything inserted while we were not listening
            while not lost.is_set():
                with anyio.move_on_after(5):
                    await lost.wait()
                if not lost.is_set():
                    await conn.execute(queries["ping"], timeout=5)  # catch a half-open socket
        finally:
            self.listening = False
            if conn is not None and not conn.is_closed():
                conn.terminate()

    async def _lease_loop(self) -> None:
        await run_every(0, self._lease_once, errors=db.RETRYABLE_ERRORS, on_error=self._lease_failed,
                        until=lambda: self.stopping)

    async def _lease_once(self) -> None:
        """Wait for a reason to lease (a notification, freed credit, a poll), then lease."""
        polled = False
        if not self._wake.is_set():
            timeout = _earliest(await self._wait_limit(), self._cold_wait(), self._shapes_wait())
            with anyio.move_on_after(timeout) as scope:
                await self._wake.wait()
            if scope.cancelled_caught:
                if self._poll_due():
                    self._notified_all = polled = True  # poll: look at every group
                elif not self._shapes_due() and self._cold_wait() != 0:
                    # else a pass reads the shapes a throttled one left unread, or places held jobs cold
                    return  # only the mark to arm again, or stragglers to check
        self._wake = anyio.Event()  # wakes during the pass trigger another pass
        if not self.stopping:
            await self._lease_pass(polled)

    async def _wait_limit(self) -> float | None:
        """How long the lease loop may wait for a wake-up (None: until one comes).

        Waiting on notifications with free credit needs a valid wake-up mark,
        and after the mark lapsed, a pass over every group once the stragglers
        have ended (docs/design.md, "Wake-ups").
        """
        if not self._any_free():
            return None  # only freed credit gives it something to do
        if self._busy:
            return self.config.busy_poll_seconds  # work keeps coming: poll, producers need not notify
        if not self.listening:
            return self.config.poll_seconds  # poll only (a pooled URL), or LISTEN lost
        now = time.monotonic()
        if now >= self._arm_at:
            await self._arm(now)
        if self._owe_pass:
            if self._stragglers:
                self._stragglers = await wakeups.stragglers_left(self.pool, self._stragglers)
            if self._stragglers:
                return STRAGGLER_POLL_SECONDS
            self._owe_pass = False
            self._notified_all = True
            self._polled_at = 0.0  # the pass is due now, even if a wake-up comes first
            return 0
        return max(0.0, min(self._arm_at, self._polled_at + self.config.poll_seconds) - now)

    async def _arm(self, now: float) -> None:
        armed = await wakeups.arm_wakeups(self.pool, WAKE_MARK_MS)
        lapsed = armed.now_ms >= self._mark_seen  # producers may have skipped NOTIFY since our last arm
        metrics.WAKEUP_ARMS.labels(lapsed=str(lapsed).lower()).inc()
        self._mark_seen = armed.until
        self._arm_at = now + (armed.until - armed.now_ms) / 2000  # half the mark's life left
        if lapsed:
            self._stragglers, self._owe_pass = armed.stragglers, True

    def _shapes_wait(self) -> float | None:
        """Seconds until a throttled read of the shapes is due (None: none owed). A wait, not a
        reason to skip arming the wake-up mark: producers must keep notifying meanwhile."""
        if not self._shapes_stale or not self.sessions or not self._any_free():
            return None
        return max(0.0, self._shapes_at + SHAPES_SECONDS - time.monotonic())

    def _cold_wait(self) -> float | None:
        """Seconds until a job held for a warm agent may go cold (None: none held, or no room)."""
        if not self._cold_at or not self._any_free():
            return None
        return max(0.0, min(self._cold_at.values()) - time.monotonic())

    def _poll_due(self) -> bool:
        return self._busy or not self.listening or time.monotonic() - self._polled_at >= self.config.poll_seconds

    def _lease_failed(self, exc: BaseException, retry_in: float) -> None:
        log.warning("lease.failed", error=str(exc), retry_in=retry_in)
        self._notified_all = True

    def _any_free(self) -> bool:
        return any(s.free or s.free_devices() or s.ready_devices() for s in self.sessions.values())

    async def _lease_pass(self, polled: bool = False) -> None:
        if self._confirm:
            await self._confirm_floors()
        notified, self._notified = self._notified, set()
        notified_all, self._notified_all = self._notified_all, False
        rewind_all, self._rewind_all = self._rewind_all, False
        credit, self._credit = self._credit, set()
        now = time.monotonic()
        if notified_all:
            self._polled_at = now
        rewind_every = self.config.poll_seconds * (REWIND_POLLS if self.listening else 1)
        if rewind_all or now - self._cursors_since > rewind_every:
            self._cursors.clear()
            self._cursors_since = now
        if polled:
            self._busy = False  # each poll decides again (passes woken by notifications only add)
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
        await self._lease_placed(notified_all, notified)

    async def _lease_placed(self, everything: bool, notified: set[str]) -> None:
        """Lease placed jobs shape by shape, each for the agents that fit it (placement.py).

        A shape whose last lease came up short is not tried again until its
        kind is notified or a poll comes, like a group in ``_empty``.
        """
        if not self.sessions:
            self._shapes_stale = self._shapes_stale or everything or bool(notified)
            return  # nobody to place on: read the shapes when an agent comes
        await self._refresh_shapes(everything or bool(notified))
        if everything:
            self._placed_empty.clear()
        elif notified:
            self._placed_empty = {key for key in self._placed_empty if key[0] not in notified}
        await self._reserve()
        work = [*self._shapes.items(), *(((k, ""), Shape.of_plain(k)) for k in self._limited_kinds)]
        for warm_only in (True, False):  # every shape's warm agents first, then the rest
            for key, shape in work:
                await self._lease_shape(key, shape, warm_only)
        # Then, prefetch: jobs no free device took wait ready on busy devices, warm ones first.
        for warm_only in (True, False):
            for key, shape in work:
                if shape.gpus and (warm_only or not self._holds_for_warm(shape)):
                    await self._lease_shape(key, shape, warm_only, ready=True)
        self._cold_at = {key: at for key, at in self._cold_at.items() if key not in self._placed_empty}

    async def _lease_shape(self, key: tuple[str, str], shape: Shape, warm_only: bool,
                           ready: bool = False) -> None:
        """Lease a shape's jobs for the agents with room (``ready``: room to hold them ready on busy
        devices); ``warm_only``: those holding its model warm, else the others, by ``_cold_slots``."""
        while key not in self._placed_empty and not self.stopping:
            slots = placement.slots(shape, self.sessions.values(), self.config.max_batch, self.reserved, warm_only,
                                    ready)
            if not slots:
                if not warm_only and not ready:
                    self._cold_at.pop(key, None)  # a hold counts only while a cold agent has room
                return
            if not warm_only and not ready and not (slots := self._cold_slots(key, shape, slots)):
                return
            with metrics.LEASE_SECONDS.time():
                if self._limited(shape):
                    jobs = await queue.lease_limited(self.pool, shape, slots, self.config.lease_seconds,
                                                     scan_keys=shape.keyed and self._key_limits)
                else:
                    jobs = await queue.lease_placed(self.pool, shape, slots, self.config.lease_seconds)
            self._busy = self._busy or bool(jobs)
            self._deliver(jobs)
            if jobs:
                log.info("lease.placed", batch=len(jobs), requested=len(slots), kind=shape.kind,
                         gpus=shape.gpus, model=shape.model, agents=len({j.leased_by for j in jobs}))
                self._unreserve(key)
            if len(jobs) < len(slots):
                self._placed_empty.add(key)

    def _cold_slots(self, key: tuple[str, str], shape: Shape, slots: list[str]) -> list[str]:
        """Of the agents that could take a shape's jobs but do not hold their model warm, those
        that may: all when no connected agent holds it; else none until one of them had room
        for warm_wait_seconds, then one agent (to load it).

        The hold counts from the first pass that kept a cold agent's room from
        the shape, not from the job's enqueue: in a backlog every job is old,
        and spilling each to a cold agent at once would evict the models the
        next jobs want. After a spill the next hold starts afresh, so a model
        in more demand than its warm agents serve spreads one agent per wait.
        """
        if not self._holds_for_warm(shape):
            return slots
        now = time.monotonic()
        if self._cold_at.setdefault(key, now + self.config.warm_wait_seconds) > now:
            return []  # the pass then is due (_cold_wait)
        del self._cold_at[key]
        return [sid for sid in slots if sid == slots[0]]

    def _holds_for_warm(self, shape: Shape) -> bool:
        """Whether the shape's jobs wait a while for an agent holding their model warm."""
        return bool(shape.model and self.config.warm_wait_seconds
                    and placement.warm_somewhere(shape, self.sessions.values()))

    async def _reserve(self) -> None:
        """Keep an agent for each multi-GPU shape whose next job has waited past reserve_after_seconds.

        Checked every RESERVE_CHECK_SECONDS (one indexed row per multi-GPU shape);
        a reservation ends when its shape leases a job, or its agent leaves.
        """
        self.reserved = {sid: key for sid, key in self.reserved.items() if sid in self.sessions}
        now = time.monotonic()
        if now < self._reserve_at:
            return
        self._reserve_at = now + min(RESERVE_CHECK_SECONDS, self.config.reserve_after_seconds)
        held = set(self.reserved.values())
        for key, shape in self._shapes.items():
            if shape.gpus < 2 or key in held:
                continue
            waited = await queue.placed_head_wait(self.pool, shape)
            if waited is None or waited < self.config.reserve_after_seconds:
                continue
            if (sid := placement.reserve(shape, self.sessions.values(), self.reserved)) is not None:
                self.reserved[sid] = key
                self._placed_empty.discard(key)
                log.info("placement.reserved", agent=sid, kind=shape.kind, gpus=shape.gpus,
                         waited_seconds=round(waited, 1))

    def _unreserve(self, key: tuple[str, str]) -> None:
        for sid in [sid for sid, k in self.reserved.items() if k == key]:
            del self.reserved[sid]
            log.info("placement.reservation_used", agent=sid, kind=key[0])

    async def unplaceable(self) -> dict[str, list[dict[str, Any]]]:
        """Pending placed jobs no connected agent could run, per kind, with the reason (for /status)."""
        pending = await queue.placed_pending(self.pool)
        if any(key not in self._shapes for key in pending):
            await self._refresh_shapes(True)
        out: dict[str, list[dict[str, Any]]] = {}
        for key, (n, oldest) in sorted(pending.items()):
            shape = self._shapes.get(key)
            if shape is None or (reason := placement.why_unplaceable(shape, list(self.sessions.values()))) is None:
                continue
            out.setdefault(shape.kind, []).append({
                "pending": n, "since": oldest.isoformat(), "gpus": shape.gpus, "gpu_memory_mb": shape.gpu_memory_mb,
                "labels": sorted(shape.labels), "model": shape.model, "reason": reason})
        return out

    def shape_by_key(self, key: tuple[str, str]) -> Shape | None:
        return self._shapes.get(key)

    def _outcomes_written(self) -> None:
        """Jobs ended in the database: limits they held may have room again (a job that ended on
        another server: the next poll)."""
        if not (self._limited_kinds or self._key_limits):
            return
        held = {k for k in self._placed_empty if k[0] in self._limited_kinds or (k in self._shapes
                                                                                 and self._limited(self._shapes[k]))}
        if held:
            self._placed_empty -= held
            self._wake.set()

    def _limited(self, shape: Shape) -> bool:
        """Whether a limit may hold the shape's jobs back: they go through lease_limited."""
        return shape.kind in self._limited_kinds or (shape.keyed and self._key_limits)

    def _shapes_due(self) -> bool:
        """A pass read no shapes though asked to (throttled): the next read is due."""
        return self._shapes_stale and bool(self.sessions) and time.monotonic() - self._shapes_at >= SHAPES_SECONDS

    async def _refresh_shapes(self, wanted: bool) -> None:
        """Read gpuq.shapes and gpuq.limits (a few rows each) when a notification or poll asks, at most
        every SHAPES_SECONDS. Until a dispatcher has read a limit, the jobs under it wait: the other
        lease statements skip them."""
        now = time.monotonic()
        self._shapes_stale = self._shapes_stale or wanted
        if self._shapes_stale and now - self._shapes_at >= SHAPES_SECONDS:
            self._shapes = {s.key: s for s in await queue.read_shapes(self.pool)}
            limits = await admin.limits(self.pool)
            self._limited_kinds = frozenset(lim["name"] for lim in limits if lim["scope"] == "kind")
            self._key_limits = any(lim["scope"] == "key" for lim in limits)
            self._shapes_at, self._shapes_stale = now, False

    async def _lease_group(self, kinds: frozenset[str], members: list[AgentSession]) -> None:
        """Lease for one group until its credit is used or the queue has no more for it."""
        while not self.stopping:
            slots = _interleave(members, self.config.max_batch)
            if not slots:
                return
            await self._settle()
            rewinds = self._rewinds
            with metrics.LEASE_SECONDS.time():
                result = await queue.lease_slots(self.pool, sorted(kinds), slots, self.config.lease_seconds,
                                                 self._cursors, self._settled)
            if rewinds == self._rewinds:  # else a drop arrived during the lease: keep it
                self._cursors.update(result.cursors)
                await self._record_floors(result.cursors)
            self._busy = self._busy or bool(result.jobs)
            self._deliver(result.jobs)
            if result.jobs or result.dead:
                log.info("lease.batch", batch=len(result.jobs), requested=len(slots), kinds=sorted(kinds),
                         agents=len({j.leased_by for j in result.jobs}), reclaimed=result.reclaimed,
                         dead=result.dead)
            if len(result.jobs) < len(slots):
                self._empty.add(kinds)
                return

    async def _settle(self) -> None:
        """Move ``_settled`` up: a horizon (the last id drawn) settles once its writers have ended."""
        now = time.monotonic()
        if now < self._settle_at:
            return
        self._settle_at = now + SETTLE_SECONDS
        if self._horizon is not None:
            last_id, writers = self._horizon
            if writers and await wakeups.stragglers_left(self.pool, writers):
                return
            self._settled = max(self._settled, last_id)
        last_id, writers = await wakeups.insert_horizon(self.pool)
        if writers:
            self._horizon = (last_id, writers)
        else:
            self._settled, self._horizon = max(self._settled, last_id), None

    async def _record_floors(self, cursors: dict[str, tuple[int, int]]) -> None:
        """Inserts above the priority a cursor reached must notify: record where it moved.

        An insert that read the old, higher floor (or none) did not notify,
        and may have committed behind the cursor, or may still: such a kind
        starts from the top at once, and again each time a transaction that
        was writing jobs when the floor moved ends.
        """
        moved = {k: p for k, (p, _id) in cursors.items() if self._floors.get(k) != p}
        if not moved or self._listen_pid is None:
            return
        lowered = {k for k, p in moved.items() if k not in self._floors or p < self._floors[k]}
        await wakeups.set_floors(self.pool, self._listen_pid, moved)
        self._floors.update(moved)
        if lowered:
            self._rewind(lowered)
            _last_id, writers = await wakeups.insert_horizon(self.pool)
            if writers:
                self._confirm.append((lowered, writers))

    async def _confirm_floors(self) -> None:
        """Rewind the kinds whose floor went down each time a writer that may have read the old floor ends."""
        everyone = sorted({x for _kinds, writers in self._confirm for x in writers})
        running = set(await wakeups.stragglers_left(self.pool, everyone))
        pending = []
        for kinds, writers in self._confirm:
            left = [x for x in writers if x in running]
            if len(left) < len(writers):  # what the ended ones inserted has committed
                self._rewind(kinds)
            if left:
                pending.append((kinds, left))
        self._confirm = pending

    def _rewind(self, kinds: set[str]) -> None:
        for kind in kinds:
            self._cursors.pop(kind, None)
            self._notified.add(kind)

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


def _earliest(*waits: float | None) -> float | None:
    """The shortest of some waits, None standing for forever."""
    return min((w for w in waits if w is not None), default=None)


def _interleave(members: list[AgentSession], limit: int) -> list[str]:
    """Each agent once per free credit, round-robin, at most ``limit`` slots."""
    random.shuffle(members)  # fairness among agents when there are fewer jobs than slots
    columns = [[s.id] * s.free for s in members]
    slots = [sid for row in itertools.zip_longest(*columns) for sid in row if sid is not None]
    return slots[:limit]
