"""Placing: which placed jobs to lease for which agents, shape by shape. It leases, never delivers.

It owns what placement needs between passes:
- the shapes enqueued so far (gpuq.shapes) and the limits (gpuq.limits), read
  when a notification or poll asks, at most every ``shapes_seconds``;
- the shapes whose last lease came up short (not tried again until their kind
  is announced or a poll comes, like a group that came up short);
- warm waits: while an agent holding a shape's model warm is connected, to
  this server or another (``Roster``: the whole fleet's agents), a cold
  agent's room goes to the shape only after ``warm_wait_seconds``;
- reservations: an agent kept for a multi-GPU shape whose next job waited past
  ``reserve_after_seconds``;
- batches: a batched kind's shape gives each slot of an agent that takes
  batches one batch of its jobs (``gpuq.batches``, like ``Batching`` for plain
  jobs); when the shape's next partial batch may go (``wait_left``). A limited
  kind's or key's jobs go one by one;
- preemption (``Preempting``): after the shapes, a GPU shape with no room
  may preempt lower-priority preemptible jobs here (it reserves their agent),
  and so may a plain job whose agents here are full.

While fair share is on (``FairShare``), a shape's single jobs lease in its
order (each slot to the tenant with the least usage per weight), and the
shape whose least such tenant is least leases first.

``lease()`` yields each leased batch; the caller delivers it before the next
one is computed, since delivery changes what each agent has free. The rules
themselves are pure functions in ``gpuq.placement``.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from typing import Any

from gpuq import admin, batches, db, logs, metrics, placement, quarantine, queue
from gpuq.config import ServerConfig
from gpuq.dispatcher.batching import Look, lease_formed
from gpuq.dispatcher.fairshare import FairShare
from gpuq.dispatcher.preempting import Preempting
from gpuq.dispatcher.roster import Roster
from gpuq.dispatcher.sessions import AgentSession, Sessions
from gpuq.dispatcher.tuning import Tuning
from gpuq.jobs import LeasedJob, Shape
from gpuq.placement import Candidate, ShapeKey

log = logs.get("dispatcher")


class Placing:
    def __init__(self, pool: Any, config: ServerConfig, tuning: Tuning, roster: Roster,
                 fair: FairShare | None = None):
        self.pool, self.config, self.tuning, self.roster = pool, config, tuning, roster
        self.fair = fair or FairShare(pool, tuning)  # while on, single jobs lease in its order
        self.shapes: dict[ShapeKey, Shape] = {}
        self._shapes_at, self._shapes_stale = -tuning.shapes_seconds, True
        self._short: set[ShapeKey] = set()  # shapes whose last lease came up short
        # Limits (gpuq.limits, read with the shapes): kinds with one, and whether any key has one.
        self._limited_kinds: frozenset[str] = frozenset()
        self._key_limits = False
        self.reserved: dict[str, ShapeKey] = {}  # agent id -> the multi-GPU shape it is kept for
        self._reserve_at = 0.0
        self._warm_wait_ends: dict[ShapeKey, float] = {}  # shape -> when a cold agent may take its next job
        self._batch_due: dict[ShapeKey, float] = {}  # batched shape -> when its next partial batch may go
        self.preempting = Preempting(pool, config, tuning)  # GPU shapes with no room, plain jobs with no slot, may preempt

    # -- a pass ------------------------------------------------------------

    async def lease(self, agents: Sessions, every: bool, kinds: set[str], stopping: Callable[[], bool],
                    batched: Mapping[str, batches.Policy] | None = None) -> AsyncIterator[list[LeasedJob]]:
        """Lease placed jobs for ``agents``, shape by shape; ``every``: look at every shape, else
        those of the announced ``kinds``, those whose partial batch may go, and those that did not
        come up short. ``batched``: the batching policies (agents that take batches get the jobs
        of those kinds in batches)."""
        if not agents:
            self._shapes_stale = self._shapes_stale or every or bool(kinds)
            return  # nobody to place on: read the shapes when an agent comes
        await self._refresh(every or bool(kinds))
        now = time.monotonic()
        due = {key for key, at in self._batch_due.items() if at <= now}
        if every:
            self._short.clear()
        elif kinds or due:
            self._short = {key for key in self._short if key[0] not in kinds and key not in due}
        await self._reserve(agents)
        if self.config.warm_wait_seconds and any(shape.model for shape in self.shapes.values()):
            await self.roster.others()  # who holds which model warm elsewhere (throttled)
        work = [*self.shapes.items(), *(((k, ""), Shape.of_plain(k)) for k in self._limited_kinds)]
        if self.fair.on:  # the shape with the least-used tenant waiting first (stable: else as read)
            work.sort(key=lambda item: self.fair.least(item[1]))
        passes = [(warm_only, False) for warm_only in (True, False)]  # every shape's warm agents first
        passes += [(warm_only, True) for warm_only in (True, False)]  # then prefetch: ready on busy devices
        for warm_only, ready in passes:
            for key, shape in work:
                if ready and not (shape.gpus and (warm_only or not self._waits_for_warm(shape, agents))):
                    continue
                async for jobs in self._lease_shape(key, shape, agents, warm_only, ready, stopping,
                                                    (batched or {}).get(shape.kind)):
                    yield jobs
        self._warm_wait_ends = {key: at for key, at in self._warm_wait_ends.items() if key not in self._short}
        # A partial batch that was due and not looked at again (no agent had room for it): a freed
        # credit looks again; no wake-up for it meanwhile, or the loop would spin.
        self._batch_due = {key: at for key, at in self._batch_due.items() if key not in due or at > now}
        if not stopping():
            await self.preempting.look(self.shapes, agents, self.reserved)

    async def _lease_shape(self, key: ShapeKey, shape: Shape, agents: Sessions, warm_only: bool, ready: bool,
                           stopping: Callable[[], bool], policy: batches.Policy | None) -> AsyncIterator[list[LeasedJob]]:
        """Lease a shape's jobs for the agents with room (``ready``: room to hold them ready on busy
        devices); ``warm_only``: those holding its model warm, else the others, after the warm wait.
        ``policy``: the kind's batching policy (a slot of an agent that takes batches takes one)."""
        while key not in self._short and not stopping():
            slots = placement.slots(shape, agents, self.config.max_batch, self.reserved, warm_only, ready)
            if not slots:
                if not warm_only and not ready:
                    self._warm_wait_ends.pop(key, None)  # a wait counts only while a cold agent has room
                return
            if not warm_only and not ready and not (slots := self._after_warm_wait(key, shape, agents, slots)):
                return
            batch_slots, slots = self._batch_slots(shape, policy, agents, slots)
            jobs: list[LeasedJob] = []
            wanted = len(slots)
            if batch_slots:
                assert policy is not None
                jobs, batch_slots = await self._lease_batches(key, shape, policy, agents, batch_slots)
                wanted += len(batch_slots)
            filled = len({j.batch for j in jobs})
            if slots:
                with metrics.LEASE_SECONDS.time():
                    if self._limited(shape):
                        single = await queue.lease_limited(self.pool, shape, slots, self.config.lease_seconds,
                                                           scan_keys=shape.keyed and self._key_limits)
                    elif self.fair.on:
                        single, more = await self.fair.lease_placed(shape, slots, self.config.lease_seconds)
                        if more:  # tenants that ran out left slots, others may fill them: not short
                            wanted -= len(slots) - len(single)
                    else:
                        single = await queue.lease_placed(self.pool, shape, slots, self.config.lease_seconds)
                if shape.gpus and any(j.failed_devices for j in single):
                    single = await self._elsewhere(shape, single, slots, agents, ready)
                if single:
                    log.info("lease.placed", batch=len(single), requested=len(slots), kind=shape.kind,
                             gpus=shape.gpus, model=shape.model, agents=len({j.leased_by for j in single}))
                jobs, filled = jobs + single, filled + len(single)
            if jobs:
                self._unreserve(key)
            if filled < wanted:
                self._short.add(key)
            yield jobs

    async def _elsewhere(self, shape: Shape, jobs: list[LeasedJob], slots: list[str], agents: Sessions,
                         ready: bool) -> list[LeasedJob]:
        """The lease's jobs, those that failed on the devices their agent would give them moved to
        another agent of the lease when one has other devices free (``placement.elsewhere``)."""
        mb = shape.gpu_memory_mb or 0
        free = {s.id: (s.ready_devices if ready else s.free_devices)(mb) for s in agents}
        moves = placement.elsewhere(jobs, slots, free, {s.id: s.name for s in agents}, shape.gpus)
        if not moves:
            return jobs
        try:
            await quarantine.move_leases(self.pool, [(j.id, j.lease_token, moves[j.id]) for j in jobs if j.id in moves])
        except db.RETRYABLE_ERRORS as exc:  # they run where leased: on the devices they failed on, perhaps
            log.warning("placement.move_failed", job_ids=sorted(moves), error=str(exc))
            return jobs
        log.info("placement.elsewhere", moves={str(i): sid for i, sid in moves.items()})
        return [dataclasses.replace(j, leased_by=moves[j.id]) if j.id in moves else j for j in jobs]

    def _batch_slots(self, shape: Shape, policy: batches.Policy | None, agents: Sessions,
                     slots: list[str]) -> tuple[list[str], list[str]]:
        """``slots`` split into those that take a batch each (agents that take batches, of a batched
        kind without a limit on it or its jobs' keys) and those that take one job."""
        if policy is None or self._limited(shape):
            return [], slots
        takers = {s.id for s in agents if s.batch_items}
        return [sid for sid in slots if sid in takers], [sid for sid in slots if sid not in takers]

    async def _lease_batches(self, key: ShapeKey, shape: Shape, policy: batches.Policy, agents: Sessions,
                             slots: list[str]) -> tuple[list[LeasedJob], list[str]]:
        """Form the shape's next batches and lease those that may go, one per slot (at most
        ``max_batch`` jobs a statement); the jobs leased, and the slots it tried to fill."""
        size = min(policy.max_items, *(s.batch_items for s in agents if s.id in slots))
        slots = slots[:max(1, self.config.max_batch // size)]
        look = await Look.take(self.pool, shape.kind, policy, size, len(slots), shape)
        self._batch_due.pop(key, None)
        if look.due_at is not None:
            self._batch_due[key] = look.due_at
        if not look.sent:
            return [], slots
        return await lease_formed(self.pool, self.config, shape.kind, look.sent, slots, shape), slots

    def _after_warm_wait(self, key: ShapeKey, shape: Shape, agents: Sessions,
                         slots: list[str]) -> list[str]:
        """Of the agents that could take a shape's jobs but do not hold their model warm, those
        that may: all when no connected agent holds it; else none until one of them had room
        for warm_wait_seconds, then one agent (to load it).

        The wait counts from the first pass that kept a cold agent's room from
        the shape, not from the job's enqueue: in a backlog every job is old,
        and spilling each to a cold agent at once would evict the models the
        next jobs want. After a spill the next wait starts afresh, so a model
        in more demand than its warm agents serve spreads one agent per wait.
        """
        if not self._waits_for_warm(shape, agents):
            return slots
        now = time.monotonic()
        if self._warm_wait_ends.setdefault(key, now + self.config.warm_wait_seconds) > now:
            return []  # the pass then is due (wait_left)
        del self._warm_wait_ends[key]
        return [sid for sid in slots if sid == slots[0]]

    def _waits_for_warm(self, shape: Shape, agents: Iterable[AgentSession]) -> bool:
        """Whether the shape's jobs wait a while for an agent holding their model warm, this
        server's or another's (as last read)."""
        return bool(shape.model and self.config.warm_wait_seconds
                    and placement.warm_somewhere(shape, itertools.chain(agents, self.roster.last_read)))

    # -- reservations ------------------------------------------------------

    async def _reserve(self, agents: Sessions) -> None:
        """Keep an agent for each multi-GPU shape whose next job has waited past reserve_after_seconds.

        Checked every ``reserve_check_seconds`` (one indexed row per multi-GPU
        shape); a reservation ends when its shape leases a job here, when its
        agent leaves, and when no job of its shape waits any more (cancelled,
        or leased by another server).
        """
        present = {s.id for s in agents}
        self.reserved = {sid: key for sid, key in self.reserved.items() if sid in present}
        now = time.monotonic()
        if now < self._reserve_at:
            return
        self._reserve_at = now + min(self.tuning.reserve_check_seconds, self.config.reserve_after_seconds)
        held = set(self.reserved.values())
        for key, shape in self.shapes.items():
            if shape.gpus < 2:
                continue
            waited = await queue.placed_head_wait(self.pool, shape)
            if key in held:
                if waited is None:
                    self._unreserve(key, "placement.reservation_ended")
                continue
            if waited is None or waited < self.config.reserve_after_seconds:
                continue
            if (sid := placement.reserve(shape, agents, self.reserved)) is not None:
                self.reserved[sid] = key
                self._short.discard(key)
                log.info("placement.reserved", agent=sid, kind=shape.kind, gpus=shape.gpus,
                         waited_seconds=round(waited, 1))

    def _unreserve(self, key: ShapeKey, event: str = "placement.reservation_used") -> None:
        for sid in [sid for sid, k in self.reserved.items() if k == key]:
            del self.reserved[sid]
            log.info(event, agent=sid, kind=key[0])

    # -- limits, shapes and when a pass is due -------------------------------

    def outcomes_written(self) -> bool:
        """Jobs ended in the database: limits they held may have room again (a job that ended on
        another server: the next poll). True if a shape may lease again: a pass is due."""
        if not (self._limited_kinds or self._key_limits):
            return False
        held = {k for k in self._short if k[0] in self._limited_kinds or (k in self.shapes
                                                                           and self._limited(self.shapes[k]))}
        self._short -= held
        return bool(held)

    def may_limit(self, kind: str) -> bool:
        """Whether a limit may hold some of ``kind``'s jobs back (a kind limit, or any key limit)."""
        return kind in self._limited_kinds or self._key_limits

    def _limited(self, shape: Shape) -> bool:
        """Whether a limit may hold the shape's jobs back: they go through lease_limited."""
        return shape.kind in self._limited_kinds or (shape.keyed and self._key_limits)

    def wait_left(self, any_room: bool) -> float | None:
        """Seconds until placement wants a pass of its own (None: never): a throttled shapes read,
        a warm wait that ends, a partial batch that may go, or the next look at whether reserved shapes still have a job waiting.
        A wait, not a reason to skip arming the wake-up mark: producers must keep notifying meanwhile."""
        preempt = self.preempting.wait_left()  # its agents are full: room or not
        if not any_room:
            return preempt
        now = time.monotonic()
        waits = [at - now for at in (*self._warm_wait_ends.values(), *self._batch_due.values())]
        if self.reserved:
            waits.append(self._reserve_at - now)
        if self._shapes_stale:
            waits.append(self._shapes_at + self.tuning.shapes_seconds - now)
        if preempt is not None:
            waits.append(preempt)
        return max(0.0, min(waits)) if waits else None

    async def _refresh(self, wanted: bool) -> None:
        """Read gpuq.shapes and gpuq.limits (a few rows each) when a notification or poll asks, at most
        every shapes_seconds. Until a dispatcher has read a limit, the jobs under it wait: the other
        lease statements skip them."""
        now = time.monotonic()
        self._shapes_stale = self._shapes_stale or wanted
        if self._shapes_stale and now - self._shapes_at >= self.tuning.shapes_seconds:
            self.shapes = {s.key: s for s in await queue.read_shapes(self.pool)}
            limits = await admin.limits(self.pool)
            self._limited_kinds = frozenset(lim["name"] for lim in limits if lim["scope"] == "kind")
            self._key_limits = any(lim["scope"] == "key" for lim in limits)
            self._shapes_at, self._shapes_stale = now, False

    async def unplaceable(self, agents: Sequence[AgentSession]) -> dict[str, list[dict[str, Any]]]:
        """Pending placed jobs no agent connected to any server could run, per kind, with the reason
        (for /status)."""
        pending = await queue.placed_pending(self.pool)
        fleet: list[Candidate] = [*agents, *await self.roster.others()]
        if any(key not in self.shapes for key in pending):
            await self._refresh(True)
        out: dict[str, list[dict[str, Any]]] = {}
        for key, (n, oldest) in sorted(pending.items()):
            shape = self.shapes.get(key)
            if shape is None or (reason := placement.why_unplaceable(shape, fleet)) is None:
                continue
            out.setdefault(shape.kind, []).append({
                "pending": n, "since": oldest.isoformat(), "gpus": shape.gpus, "gpu_memory_mb": shape.gpu_memory_mb,
                "labels": sorted(shape.labels), "model": shape.model, "reason": reason})
        return out
