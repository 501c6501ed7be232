"""Group leases: plain jobs for the agents that take the same kinds, one statement per batch.

A group leases at most its members' free credit at once (``queue.lease_slots``),
starting each kind at its cursor. This part does the reads and writes the
cursors ask for (settled horizon, floors, writers to confirm: ``cursors.py``
decides) and remembers which groups came up short: such a group is not tried
again until one of its kinds is announced, a poll comes, or its agents free
credit.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from gpuq import logs, metrics, queue, wakeups
from gpuq.config import ServerConfig
from gpuq.dispatcher.cursors import Cursors
from gpuq.dispatcher.fairshare import FairShare
from gpuq.dispatcher.sessions import AgentSession, Sessions, interleave
from gpuq.dispatcher.trigger import Pass
from gpuq.dispatcher.tuning import Tuning
from gpuq.jobs import LeasedJob

log = logs.get("dispatcher")


class GroupLeases:
    def __init__(self, pool: Any, config: ServerConfig, tuning: Tuning, listen_pid: Callable[[], int | None],
                 recheck: Callable[[set[str]], None], fair: FairShare | None = None):
        self.pool, self.config, self.tuning = pool, config, tuning
        self.fair = fair or FairShare(pool, tuning)  # while on, plain jobs lease in its order (no cursors)
        self._listen_pid = listen_pid  # floors are recorded under our LISTEN connection's pid
        self._recheck = recheck  # kinds a lowered floor sent back to the top: the next pass looks at them
        self.cursors = Cursors(time.monotonic())
        self._short: set[frozenset[str]] = set()  # groups whose last lease came up short
        self._rotation = 0

    def agent_came(self, kinds: frozenset[str]) -> None:
        """A new agent, or new labels or models: its group may lease again."""
        self._short.discard(kinds)

    async def lease(self, sessions: Sessions, why: Pass, listening: bool, stopping: Callable[[], bool],
                    batched: frozenset[str] = frozenset()) -> AsyncIterator[list[LeasedJob]]:
        """Lease for each group with a reason to; yields each batch (deliver it before the next).
        ``batched``: kinds the agents that take batches get only from ``Batching``."""
        if self.cursors.confirm:  # kinds a writer that ended may have put jobs behind: this pass too
            why.kinds |= await self._confirm_floors()
        rewind_every = self.config.poll_seconds * (self.tuning.rewind_polls if listening else 1)
        self.cursors.start_pass(time.monotonic(), why.rewind, rewind_every)
        order = list(sessions.groups(batched).items())
        self._rotation += 1
        if order:  # rotate so no group always goes first
            k = self._rotation % len(order)
            order = order[k:] + order[:k]
        for kinds, members in order:
            if why.every or kinds & why.kinds:
                self._short.discard(kinds)
            elif kinds not in why.credit or kinds in self._short:
                continue
            async for jobs in self._lease_group(kinds, members, stopping):
                yield jobs

    async def _lease_group(self, kinds: frozenset[str], members: list[AgentSession],
                           stopping: Callable[[], bool]) -> AsyncIterator[list[LeasedJob]]:
        """Lease for one group until its credit is used or the queue has no more for it."""
        while not stopping():
            slots = interleave(members, self.config.max_batch)
            if not slots:
                return
            if self.fair.on:
                with metrics.LEASE_SECONDS.time():
                    jobs, more = await self.fair.lease(sorted(kinds), slots, self.config.lease_seconds)
                if jobs:
                    log.info("lease.batch", batch=len(jobs), requested=len(slots), kinds=sorted(kinds),
                             agents=len({j.leased_by for j in jobs}), fair=True)
                if not more:
                    self._short.add(kinds)
                yield jobs
                if not more:
                    return
                continue
            await self._settle()
            rewinds = self.cursors.rewinds
            with metrics.LEASE_SECONDS.time():
                result = await queue.lease_slots(self.pool, sorted(kinds), slots, self.config.lease_seconds,
                                                 self.cursors.cursors, self.cursors.settled)
            moved = self.cursors.leased(result.cursors, rewinds)
            if result.jobs or result.dead:
                log.info("lease.batch", batch=len(result.jobs), requested=len(slots), kinds=sorted(kinds),
                         agents=len({j.leased_by for j in result.jobs}), reclaimed=result.reclaimed,
                         dead=result.dead)
            short = len(result.jobs) < len(slots)
            if short:
                self._short.add(kinds)
            yield result.jobs  # delivered before anything else can fail
            if moved:
                await self._record_floors(moved)
            if short:
                return

    async def _settle(self) -> None:
        """Move the settled id up: a horizon (the last id drawn) settles once its writers have ended."""
        if not self.cursors.settle_due(time.monotonic(), self.tuning.settle_seconds):
            return
        writers = self.cursors.horizon_writers()
        if writers and await wakeups.stragglers_left(self.pool, writers):
            return
        self.cursors.horizon_ended()
        self.cursors.new_horizon(*await wakeups.insert_horizon(self.pool))

    async def _record_floors(self, moved: dict[str, int]) -> None:
        """Inserts above the priority a cursor reached must notify: record where it moved.

        An insert that read the old, higher floor (or none) did not notify,
        and may have committed behind the cursor, or may still: such a kind
        starts from the top at once, and again each time a transaction that
        was writing jobs when the floor moved ends.
        """
        if (pid := self._listen_pid()) is None:
            return
        await wakeups.set_floors(self.pool, pid, moved)
        if lowered := self.cursors.floors_recorded(moved):
            self._recheck(lowered)
            _last_id, writers = await wakeups.insert_horizon(self.pool)
            self.cursors.confirm_after(lowered, writers)

    async def _confirm_floors(self) -> set[str]:
        """Rewind the kinds whose floor went down each time a writer that may have read the old floor ends."""
        running = set(await wakeups.stragglers_left(self.pool, self.cursors.confirm_writers()))
        return self.cursors.writers_running(running)

    async def listen_connected(self, pid: int) -> None:
        """A new LISTEN connection: clear our floors from before (and the dead's); the cursors and
        the settled horizon start afresh."""
        await wakeups.clear_floors(self.pool, pid)
        self.cursors.restart(time.monotonic())
