"""Priority preemption: which running preemptible jobs a blocked higher-priority job may ask to yield.

A pure function over the fleet's view (``Box``: an agent and the jobs it
holds) and the blocked job (``Blocked``); the dispatcher builds both and asks
``gpuq.preempt`` for the ids it returns (docs/design.md, "Preemption"). The
rules:

- only a job that is preemptible, of a **lower** priority than the blocked
  job, and that has run at least ``min_run_seconds`` may be a victim;
- the victims free a fitting device set on **one** agent the blocked job
  could run on (its hard requirements: ``Box.fits``): enough devices of the
  memory it needs, each with no other job on it but victims and jobs held
  ready that are preemptible (those are given back at once, at no cost, and
  are not victims: they never started);
- **never more victims than needed**: the fewest victims, then the lowest
  priorities, then the least work lost (the shortest run);
- a plain job (no devices) needs one slot of an agent's credit (``Box.slots``):
  one victim among the agent's jobs without devices frees it; one held ready
  there is blocked by its running ones (``for_ready_slot``);
- while earlier victims are still yielding (asked within their grace time),
  the devices they free count as freed already: no new victim until then;
- a job the dispatcher pushed to wait ready for busy devices (prefetch) is
  blocked there: the running jobs on its devices are its victims under the
  same rules (``for_ready``), and it starts as they stop.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

MAX_VICTIM_SETS = 4096  # subsets tried on one agent at most (an agent holds a few jobs: 2**8 for 8 GPUs)


@dataclass(frozen=True, slots=True)
class Held:
    """A job an agent holds, as preemption sees it."""

    id: int
    devices: tuple[int, ...]
    started: bool  # its handler runs (else it waits ready for its devices)
    preemptible: bool = False
    priority: int = 0
    ran_seconds: float = 0.0
    yielding: bool = False  # asked to yield already, within its grace time


@dataclass(frozen=True, slots=True)
class Box:
    """An agent the blocked job could run on (its kind, labels, protocol), and what it holds."""

    id: str
    devices: tuple[int, ...]  # the indices with enough memory for the blocked job
    held: tuple[Held, ...]
    slots: int = 0  # plain jobs' free credit: a plain blocked job's room (it needs one)


@dataclass(frozen=True, slots=True)
class Blocked:
    """The highest-priority waiting job of a shape no agent has room for."""

    priority: int
    gpus: int  # 0: a plain job (one slot of an agent's credit)


@dataclass(frozen=True, slots=True)
class Choice:
    """What to ask on agent ``agent``: ``victims`` (running jobs that yield) and ``released`` (ready
    jobs given back); ``waiting``: victims asked earlier free enough already (no new victim)."""

    agent: str
    victims: tuple[int, ...] = ()
    released: tuple[int, ...] = ()
    waiting: bool = False

    @property
    def ids(self) -> list[int]:
        return [*self.victims, *self.released]


def choose(blocked: Blocked, boxes: Iterable[Box], min_run_seconds: float) -> Choice | None:
    """The agent and the fewest, lowest-priority victims that free a fitting device set for the
    blocked job there (a choice with no victim: it has room, or victims asked earlier free one
    already, ``waiting``, or ready jobs given back do); None when no agent can be freed under the
    rules."""
    best: tuple[tuple[int, int, float], Choice] | None = None
    for box in boxes:
        choice = (_on_box if blocked.gpus else _on_slots)(blocked, box, min_run_seconds)
        if choice is None:
            continue
        victims = [h for h in box.held if h.id in choice.victims]
        rank = (len(victims), max((h.priority for h in victims), default=-(2**31)),
                sum(h.ran_seconds for h in victims))
        if best is None or rank < best[0]:
            best = rank, choice
    return None if best is None else best[1]


def _on_box(blocked: Blocked, box: Box, min_run_seconds: float) -> Choice | None:
    """The fewest victims on this agent (then the lowest priorities, the shortest runs) that free
    ``blocked.gpus`` of its fitting devices; None when it cannot be freed."""
    on: dict[int, list[Held]] = {d: [] for d in box.devices}
    for h in box.held:
        for d in h.devices:
            if d in on:
                on[d].append(h)
    free = sum(not jobs for jobs in on.values())
    if free >= blocked.gpus:
        return Choice(box.id)  # room already: nothing to ask
    # A device can be freed when every job on it goes: victims (running), or ready ones given back.
    freeable = {d: jobs for d, jobs in on.items()
                if jobs and all(_may_go(h, blocked, min_run_seconds) for h in jobs)}
    candidates = sorted({h.id: h for jobs in freeable.values() for h in jobs if h.started and not h.yielding}.values(),
                        key=lambda h: (h.priority, h.ran_seconds, h.id))
    sets = itertools.chain.from_iterable(itertools.combinations(candidates, n) for n in range(len(candidates) + 1))
    for victims in itertools.islice(sets, MAX_VICTIM_SETS):
        chosen = {h.id for h in victims}
        freed = [d for d, jobs in freeable.items() if all(h.id in chosen or h.yielding or not h.started for h in jobs)]
        if free + len(freed) >= blocked.gpus:
            released = sorted({h.id for d in freed for h in on[d] if not h.started and not h.yielding})
            waiting = any(h.yielding for d in freed for h in on[d])
            return Choice(box.id, tuple(sorted(chosen)), tuple(released), waiting and not chosen)
    return None


def _on_slots(blocked: Blocked, box: Box, min_run_seconds: float) -> Choice | None:
    """A plain job needs one slot of the agent's credit (its jobs without devices): room when one is
    free; else a job asked earlier frees one already (``waiting``: no new victim); else a ready job
    that may go is given back (it never started: no cost); else the one running victim of the lowest
    priority (then the shortest run). None when none may go."""
    if box.slots > 0:
        return Choice(box.id)
    plain = [h for h in box.held if not h.devices]
    if any(h.yielding for h in plain):
        return Choice(box.id, waiting=True)
    may_go = sorted((h for h in plain if _may_go(h, blocked, min_run_seconds)),
                    key=lambda h: (h.started, h.priority, h.ran_seconds, h.id))
    if not may_go:
        return None
    first = may_go[0]
    return Choice(box.id, released=(first.id,)) if not first.started else Choice(box.id, victims=(first.id,))


def for_ready_slot(box: Box, min_run_seconds: float) -> Choice | None:
    """Plain jobs held ready while the agent's running jobs take its capacity: the highest-priority
    one is blocked there, and one running job without devices may yield for it under the same
    rules (it starts as that one stops); None when none may go, or one yields already."""
    waiting = [h for h in box.held if not h.devices and not h.started]
    if not waiting:
        return None
    running = Box(box.id, (), tuple(h for h in box.held if h.started and not h.devices))
    choice = _on_slots(Blocked(max(h.priority for h in waiting), 0), running, min_run_seconds)
    return choice if choice is not None and choice.victims else None


def for_ready(box: Box, min_run_seconds: float) -> list[int]:
    """Victims for the jobs an agent holds ready for busy devices (the dispatcher pushed a job that
    found no free device to wait there): the running jobs on a ready job's devices, when every one
    of them may go for it (preemptible, of a lower priority, run long enough); those yielding
    already are not asked again. The ready job starts there as they stop."""
    victims: set[int] = set()
    for waiting in (h for h in box.held if not h.started and h.devices):
        blockers = [h for h in box.held if h.started and set(h.devices) & set(waiting.devices)]
        need = Blocked(waiting.priority, len(waiting.devices))
        if blockers and all(_may_go(h, need, min_run_seconds) for h in blockers):
            victims.update(h.id for h in blockers if not h.yielding)
    return sorted(victims)


def _may_go(h: Held, blocked: Blocked, min_run_seconds: float) -> bool:
    """Whether ``h`` may leave its device for the blocked job: a preemptible job of a lower priority,
    running for at least ``min_run_seconds`` (or yielding already), or waiting ready (given back)."""
    if not h.preemptible or h.priority >= blocked.priority:
        return False
    return h.yielding or not h.started or h.ran_seconds >= min_run_seconds


def eligible_in(held: Sequence[Held], blocked: Blocked, min_run_seconds: float) -> float | None:
    """Seconds until a running job that would be a victim but for ``min_run_seconds`` has run long
    enough (None: none): when to look again."""
    waits = [min_run_seconds - h.ran_seconds for h in held
             if h.started and h.preemptible and not h.yielding and h.priority < blocked.priority
             and h.ran_seconds < min_run_seconds]
    return max(0.0, min(waits)) if waits else None
