"""Batching: a batched kind's next jobs, formed into batches and leased for the agents that take them.

It owns what batching needs between passes:
- the policies (gpuq.batch_policies), read when a notification or poll asks,
  at most every ``shapes_seconds``;
- the kinds whose last look found nothing to send (not looked at again until
  the kind is announced, a poll comes, or an agent that takes it frees credit);
- when each kind's next partial batch may go (its oldest job's wait reaches
  ``max_wait_ms``): the dispatcher wakes for it (``wait_left``).

A pass reads the kind's next jobs (``batch_head``: as many as the batch-taking
agents' free credit times the batch size, locking nothing), forms batches
(``gpuq.batches``), and leases the jobs of those that may go, each batch for
one credit of one agent (``lease_batched``). Jobs of a batch still forming stay
pending: a crash loses nothing, a cancel is an ordinary cancel. Agents that do
not take batches get the kind's jobs one by one, as before. Placed jobs of a
batched kind form batches per shape in ``Placing`` (``lease_formed``, one slot
a batch); a limited kind's or key's jobs go one by one.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from gpuq import admin, batches, logs, metrics, queue
from gpuq.config import ServerConfig
from gpuq.dispatcher.sessions import AgentSession, Sessions
from gpuq.dispatcher.trigger import Pass
from gpuq.dispatcher.tuning import Tuning
from gpuq.jobs import LeasedJob, Shape

log = logs.get("dispatcher")

# A look reads this many batches' worth of the kind's next jobs per free credit: jobs of
# several keys interleave, and a head of exactly one batch per credit would split into small ones.
HEAD_READ = 2
# Looks in a row that lease nothing (another server leased the head first) before the pass moves on.
FRUITLESS_LOOKS = 3


class Batching:
    def __init__(self, pool: Any, config: ServerConfig, tuning: Tuning):
        self.pool, self.config, self.tuning = pool, config, tuning
        self.policies: dict[str, batches.Policy] = {}
        self._read_at, self._stale = -tuning.shapes_seconds, True
        self._short: set[str] = set()  # kinds whose last look sent nothing
        self._due: dict[str, float] = {}  # kind -> when (monotonic) its next partial batch may go
        self._rotation = 0

    @property
    def kinds(self) -> frozenset[str]:
        """The batched kinds: agents that take batches get their jobs only in batches."""
        return frozenset(self.policies)

    async def lease(self, sessions: Sessions, why: Pass, stopping: Callable[[], bool]) -> AsyncIterator[list[LeasedJob]]:
        """Lease batches of each batched kind with a reason to look; yields each statement's batches
        (the jobs of one batch together, each job's ``batch`` its number). ``refresh`` first."""
        kinds = list(self.policies.items())
        self._rotation += 1
        if kinds:  # rotate so no batched kind always goes first
            k = self._rotation % len(kinds)
            kinds = kinds[k:] + kinds[:k]
        for kind, policy in kinds:
            takers = [s for s in sessions if s.batch_items and kind in s.kinds and not s.draining]
            if not any(s.free for s in takers):
                self._due.pop(kind, None)  # no credit to wait for it with: a freed credit looks again
                continue
            if self._worth_a_look(kind, why, time.monotonic()):
                async for jobs in self._lease_kind(kind, policy, takers, stopping):
                    yield jobs

    def _worth_a_look(self, kind: str, why: Pass, now: float) -> bool:
        due = self._due.get(kind)
        if why.every or kind in why.kinds or any(kind in group for group in why.credit) or (due is not None and due <= now):
            self._short.discard(kind)
        return kind not in self._short

    async def _lease_kind(self, kind: str, policy: batches.Policy, takers: list[AgentSession],
                          stopping: Callable[[], bool]) -> AsyncIterator[list[LeasedJob]]:
        """Form the kind's next batches and lease those that may go, one per free credit, at most
        ``max_batch`` jobs a statement, until the credit is used or nothing more may go."""
        size = min(policy.max_items, *(s.batch_items for s in takers))
        per_statement = max(1, self.config.max_batch // size)
        fruitless = 0
        while not stopping() and fruitless < FRUITLESS_LOOKS:
            credits = [s.id for s in _by_credit(takers)][:per_statement]
            if not credits:
                return
            look = await Look.take(self.pool, kind, policy, size, len(credits))
            self._due.pop(kind, None)
            if look.due_at is not None:
                self._due[kind] = look.due_at
            if not look.sent:
                if look.due_at is None:
                    self._short.add(kind)  # nothing waits: until something is announced or frees
                return
            jobs = await lease_formed(self.pool, self.config, kind, look.sent, credits)
            fruitless = 0 if jobs else fruitless + 1  # none: another server took them first
            yield jobs
            if look.all_sent and len(jobs) == sum(len(b.jobs) for b in look.sent):
                if look.due_at is None:
                    self._short.add(kind)  # all it had went
                return

    def outcomes_written(self, may_limit: Callable[[str], bool]) -> bool:
        """Jobs ended in the database: a batched kind whose last look sent nothing while a limit
        may have held its jobs back looks again (its agents' freed credit came before the commit
        that frees the limit). True if one may: a pass is due."""
        held = {kind for kind in self._short if may_limit(kind)}
        self._short -= held
        return bool(held)

    def wait_left(self, sessions: Sessions) -> float | None:
        """Seconds until a partial batch may go, or a throttled read of the policies is due, while an
        agent that takes batches is connected (None: nothing waits)."""
        if not any(s.batch_items for s in sessions):
            return None
        now = time.monotonic()
        waits = [at - now for at in self._due.values()]
        if self._stale:
            waits.append(self._read_at + self.tuning.shapes_seconds - now)
        return max(0.0, min(waits)) if waits else None

    async def refresh(self, sessions: Sessions, why: Pass) -> None:
        """Read gpuq.batch_policies (a few rows) when a notification or poll asks, at most every
        shapes_seconds, while an agent that takes batches is connected (for the others a policy
        changes nothing)."""
        if not any(s.batch_items for s in sessions):
            self._stale = self._stale or why.every or bool(why.kinds)
            return
        wanted, now = why.every or bool(why.kinds), time.monotonic()
        self._stale = self._stale or wanted
        if self._stale and now - self._read_at >= self.tuning.shapes_seconds:
            self.policies = {p["kind"]: batches.Policy(p["max_items"], p["max_wait_ms"], p["max_cost"])
                             for p in await admin.batching(self.pool)}
            self._due = {k: at for k, at in self._due.items() if k in self.policies}
            self._read_at, self._stale = now, False


@dataclasses.dataclass(frozen=True, slots=True)
class Look:
    """One look at a batched kind's (or shape's) next jobs: the batches that may go now, one per slot."""

    sent: list[batches.Batch]
    due_at: float | None  # when (monotonic) the next partial batch may go; None: none waits
    all_sent: bool  # every job of the head is in ``sent``: nothing more may go now

    @classmethod
    async def take(cls, pool: Any, kind: str, policy: batches.Policy, size: int, slots: int,
                   shape: Shape | None = None) -> Look:
        """Read the head (``HEAD_READ`` batches' worth a slot: jobs of several keys interleave) and
        form its batches (``gpuq.batches``)."""
        limit = slots * size * HEAD_READ
        head = await queue.batch_head(pool, kind, limit, shape)
        go, due_in = batches.ready(batches.form(head, size, policy.max_cost), policy.max_wait_ms)
        due_at = None if due_in is None else time.monotonic() + due_in / 1000
        return cls(go[:slots], due_at, len(go) <= slots and len(head) < limit)


async def lease_formed(pool: Any, config: ServerConfig, kind: str, sent: list[batches.Batch], slots: list[str],
                       shape: Shape | None = None) -> list[LeasedJob]:
    """Lease each formed batch for the agent of its slot (plain jobs, or ``shape``'s); the jobs
    leased, each with its batch's number."""
    with metrics.LEASE_SECONDS.time():
        leased = await queue.lease_batched(pool, kind, [(sid, [j.id for j in batch.jobs])
                                                        for batch, sid in zip(sent, slots, strict=False)],
                                           config.lease_seconds, shape)
    out = []
    for batch in sent:
        # A batch is named by its first job's id (gpuq.jobs.batch_id); a skipped job leaves it smaller.
        members = [j for j in batch.jobs if j.id in leased]
        if members:
            metrics.BATCH_SIZE.labels(kind=kind).observe(len(members))
            for j in members:
                metrics.BATCH_FORMING_SECONDS.labels(kind=kind).observe(j.waited_ms / 1000)
        out += [leased[j.id] for j in members]
    log.info("lease.batches", kind=kind, batches=len(sent), jobs=len(out), gpus=shape.gpus if shape else 0)
    return out


def _by_credit(agents: list[AgentSession]) -> list[AgentSession]:
    """Each agent once per free credit, round-robin: batches spread over the agents."""
    columns = [[s] * s.free for s in agents]
    return [s for row in itertools.zip_longest(*columns) for s in row if s is not None]
