"""Preempting: a GPU shape whose next job finds no room on this server's agents, or a kind whose
next plain job finds no free credit on them, may preempt lower-priority preemptible jobs running
there. It asks, never delivers.

It owns what the look needs between passes:
- when it last looked (at most every ``Tuning.preempt_check_seconds``), and
  whether a look is owed (a pass came before that: ``wait_left``);
- the agents it reserved for a blocked shape (``Placing.reserved``, shared):
  the devices its victims free go to that shape alone, not back to the
  victims' (``placement.room``), until the shape leases a job there (placing
  ends it) or has no job waiting any more (ended here).

The choice itself is ``gpuq.preemption.choose``, a pure function over the
fleet's view (``Box``: each agent that could run the shape, its fitting
devices and the jobs it holds, with what the database says of them) and the
blocked job (the shape's next job's priority; a plain job's: the head of
jobs_pending_idx for its kind, one index probe, read only while every agent
taking the kind is full and one of them holds a preemptible job). A plain
victim's freed credit goes to the urgent job: group leases, in priority order,
come before the placed ones in a pass. The ask is ``gpuq.preempt``, as
``gpuq preempt`` asks, and the victims' agents, this server's, are told at once.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

from gpuq import admin, logs, placement, preemption, preemptions
from gpuq.config import ServerConfig
from gpuq.dispatcher.sessions import AgentSession, Sessions
from gpuq.dispatcher.tuning import Tuning
from gpuq.jobs import Shape
from gpuq.placement import ShapeKey

log = logs.get("dispatcher")


class Preempting:
    def __init__(self, pool: Any, config: ServerConfig, tuning: Tuning):
        self.pool, self.config, self.tuning = pool, config, tuning
        self._looked_at = -tuning.preempt_check_seconds
        self._owed = False  # a pass came within the interval: look at its end
        self._eligible_at: float | None = None  # when a job blocking another has run long enough to yield
        self._mine: dict[str, ShapeKey] = {}  # agent id -> the blocked shape this part reserved it for
        self._full = False  # at the last look, a kind's agents were full with a preemptible job: look again

    def wait_left(self) -> float | None:
        """Seconds until a look is owed (None: none): one a pass came too early for, or one when a
        job that would be a victim has run long enough."""
        now = time.monotonic()
        due = self._owed or self._full  # full agents: a plain job inserted meanwhile may not notify (no room, no mark)
        waits = [self._looked_at + self.tuning.preempt_check_seconds - now] if due else []
        if self._eligible_at is not None:
            waits.append(self._eligible_at - now)
        return max(0.0, min(waits)) if waits else None

    async def look(self, shapes: Mapping[ShapeKey, Shape], agents: Sessions, reserved: dict[str, ShapeKey]) -> None:
        """For each preemption-minded GPU shape with no room on any agent here: ask victims to yield,
        and keep their agent for the shape (``reserved``); for each kind whose agents here are all full
        while one holds a preemptible job: one victim for its next plain job, if of a higher priority."""
        self._forget_ended(reserved)
        if not any(s.preemptible for s in shapes.values()):
            return  # no preemptible job was ever enqueued: nothing to preempt
        # Blocked: no free devices, nor busy ones to wait on (then it is pushed to wait there: for_ready).
        blocked = [(key, shape) for key, shape in shapes.items()
                   if shape.gpus and not placement.slots(shape, agents, 1, reserved)
                   and not placement.slots(shape, agents, 1, reserved, ready=True)
                   and any(placement.could_run(shape, a) for a in agents)]
        waiting = [s for s in agents if s.protocol.ledger.unstarted() and s.protocol.ledger.devices_in_use]
        gpu = bool(blocked or waiting) and any(s.protocol.ledger.devices_in_use for s in agents)
        full, ready = _full_kinds(agents), _ready_behind_preemptible(agents)
        if not (gpu or full or ready):
            self._eligible_at, self._full = None, False
            return  # no GPU job waits for devices here, no plain job can be blocked by a preemptible one
        now = time.monotonic()
        if now - self._looked_at < self.tuning.preempt_check_seconds:
            self._owed = True
            return
        self._looked_at, self._owed, self._full = now, False, bool(full or ready)
        views = await self._held(agents)
        for session in waiting if gpu else ():
            await self._for_ready(session, views, agents)
        for key, shape in blocked if gpu else ():
            await self._for_shape(key, shape, agents, views, reserved)
        for kind in sorted(full):
            await self._for_kind(kind, agents, views)
        for session in ready:
            await self._for_ready_slot(session, views, agents)
        # A job too young to be a victim now may be one later: look again then (for any priority above it).
        held = [h for session in agents for h in _box(session, None, views).held]
        young = preemption.eligible_in(held, preemption.Blocked(2**31, 0), self.config.preempt_min_run_seconds)
        self._eligible_at = None if young is None else now + young + 0.01

    async def _for_ready(self, session: AgentSession, views: dict[int, preemption.Held], agents: Sessions) -> None:
        """Jobs held ready on this agent's busy devices: the running jobs there may have to yield."""
        if victims := preemption.for_ready(_box(session, None, views), self.config.preempt_min_run_seconds):
            asked = await self._ask(victims, agents)
            log.info("preempt.priority", agent=session.id, victims=victims, asked=sorted(asked),
                     reason="a higher-priority job waits ready for their devices")

    async def _for_shape(self, key: ShapeKey, shape: Shape, agents: Sessions,
                         views: dict[int, preemption.Held], reserved: dict[str, ShapeKey]) -> None:
        priority = await preemptions.head_priority(self.pool, shape)
        if priority is None:
            self._release(key, reserved)
            return
        boxes = [_box(s, shape, views) for s in agents
                 if placement.could_run(shape, s) and not s.draining and reserved.get(s.id, key) == key]
        choice = preemption.choose(preemption.Blocked(priority, shape.gpus), boxes,
                                   self.config.preempt_min_run_seconds)
        if choice is None or not (choice.ids or choice.waiting):
            return
        reserved[choice.agent] = self._mine[choice.agent] = key
        if choice.ids:
            asked = await self._ask(choice.ids, agents)
            log.info("preempt.priority", agent=choice.agent, kind=shape.kind, gpus=shape.gpus, priority=priority,
                     victims=list(choice.victims), released=list(choice.released), asked=sorted(asked))

    async def _for_kind(self, kind: str, agents: Sessions, views: dict[int, preemption.Held]) -> None:
        """The kind's next plain job, when its priority is above a preemptible job's on a full agent
        taking the kind: one victim yields its slot (or a ready one is given back)."""
        priority = await preemptions.plain_head_priority(self.pool, kind)
        if priority is None:
            return
        boxes = [_slots_box(s, views) for s in agents if kind in s.kinds and not s.draining]
        choice = preemption.choose(preemption.Blocked(priority, 0), boxes, self.config.preempt_min_run_seconds)
        if choice is None or not choice.ids:
            return
        asked = await self._ask(choice.ids, agents)
        log.info("preempt.priority", agent=choice.agent, kind=kind, gpus=0, priority=priority,
                 victims=list(choice.victims), released=list(choice.released), asked=sorted(asked))

    async def _for_ready_slot(self, session: AgentSession, views: dict[int, preemption.Held], agents: Sessions) -> None:
        """Plain jobs held ready on this agent behind its running ones: one of those may have to yield."""
        box = _slots_box(session, views)
        if choice := preemption.for_ready_slot(box, self.config.preempt_min_run_seconds):
            asked = await self._ask(choice.ids, agents)
            priority = max(h.priority for h in box.held if not h.started)
            log.info("preempt.priority", agent=session.id, gpus=0, priority=priority, victims=list(choice.victims),
                     asked=sorted(asked), reason="a higher-priority plain job waits ready for a slot")

    async def _ask(self, ids: list[int], agents: Sessions) -> dict[int, float]:
        """``gpuq.preempt`` them, and tell their agents at once (they are this server's: the NOTIFY that
        follows finds them asked already, and a server that only polls gets none)."""
        asked = await admin.preempt(self.pool, *ids)
        for grace in set(asked.values()):
            agents.preempt_running([i for i, g in asked.items() if g == grace], grace)
        return asked

    async def _held(self, agents: Sessions) -> dict[int, preemption.Held]:
        """Every job with devices, every preemptible one and every one held ready, held by this
        server's agents, as preemption sees it."""
        ids = {i for s in agents
               for i in (*s.protocol.ledger.devices_in_use, *s.protocol.ledger.preemptible, *s.protocol.ledger.unstarted())}
        rows = await preemptions.held(self.pool, sorted(ids))
        return {r["id"]: preemption.Held(r["id"], (), False, r["preemptible"], r["priority"],
                                         r["ran_seconds"] or 0.0, r["yielding"]) for r in rows}

    def _release(self, key: ShapeKey, reserved: dict[str, ShapeKey]) -> None:
        """The shape has no job waiting: the agents kept for it are free again."""
        for sid in [sid for sid, k in self._mine.items() if k == key]:
            del self._mine[sid]
            if reserved.get(sid) == key:
                del reserved[sid]
                log.info("placement.reservation_ended", agent=sid, kind=key[0], reason="preemption")

    def _forget_ended(self, reserved: dict[str, ShapeKey]) -> None:
        """Reservations placing ended (the shape leased a job there, or the agent left) are not ours now."""
        self._mine = {sid: k for sid, k in self._mine.items() if reserved.get(sid) == k}


def _box(session: AgentSession, shape: Shape | None, views: dict[int, preemption.Held]) -> preemption.Box:
    """The agent as preemption sees it: its devices with enough memory for the shape (any shape:
    all), quarantined ones left out, and the jobs on its devices."""
    ledger = session.protocol.ledger
    least = (shape.gpu_memory_mb or 0) if shape is not None else 0
    fitting = tuple(d.index for d in session.devices if d.memory_mb >= least and d.index not in ledger.quarantined)
    started = set(ledger.started_ids())
    held = tuple(_seen(job_id, devices, job_id in started, views) for job_id, devices in ledger.devices_in_use.items())
    return preemption.Box(session.id, fitting, held)


def _seen(job_id: int, devices: tuple[int, ...], started: bool, views: dict[int, preemption.Held]) -> preemption.Held:
    """A job an agent here holds, with what the database said of it (nothing, for a job that just
    ended: not preemptible)."""
    seen = views.get(job_id) or preemption.Held(job_id, (), False)
    return dataclasses.replace(seen, devices=devices, started=started)


def _full_kinds(agents: Sessions) -> set[str]:
    """Kinds whose agents here have no free credit while one of them holds a preemptible job without
    devices: a plain job of theirs may be blocked by it (the ledgers only: no database read)."""
    taking = [s for s in agents if not s.draining]
    open_kinds = {k for s in taking if s.free for k in s.kinds}
    held = {k for s in taking for k in s.kinds
            if any(i not in s.protocol.ledger.devices_in_use for i in s.protocol.ledger.preemptible)}
    return held - open_kinds


def _ready_behind_preemptible(agents: Sessions) -> list[AgentSession]:
    """Agents holding a plain job ready while a preemptible job without devices runs there: the
    ready one may be of a higher priority (the ledgers only)."""
    out = []
    for s in agents:
        ledger = s.protocol.ledger
        plain = [i for i in ledger.held if i not in ledger.devices_in_use]
        started = set(ledger.started_ids())
        if any(i not in started for i in plain) and any(i in started and i in ledger.preemptible for i in plain):
            out.append(s)
    return out


def _slots_box(session: AgentSession, views: dict[int, preemption.Held]) -> preemption.Box:
    """The agent as a plain job's preemption sees it: its free credit and the jobs it holds without
    devices (what the database did not say of one: not preemptible)."""
    ledger = session.protocol.ledger
    started = set(ledger.started_ids())
    held = tuple(_seen(job_id, (), job_id in started, views) for job_id in ledger.held if job_id not in ledger.devices_in_use)
    return preemption.Box(session.id, (), held, slots=session.free)
