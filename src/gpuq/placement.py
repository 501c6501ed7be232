"""Placement rules: which connected agents may run a shape's jobs, in what order, and why none can.

Pure functions over ``Shape`` and what agents said in their hello
(``Candidate``: the dispatcher's sessions). The rules (docs/design.md, "GPU
placement"):

- hard requirements are never bent: the kind, protocol 4 (an older agent
  cannot say what it has, so it gets plain jobs only), protocol 9 for a
  preemptible job (an older agent cannot yield it), every label, and
  ``gpus`` free devices with at least ``gpu_memory_mb`` each, on one agent;
- a job without GPUs takes the agent's plain credit (``capacity``); one with
  GPUs takes devices, one job per device;
- among agents that fit, those holding the job's model warm come first (a
  model it reported, or one a job it holds named: loaded, or loading); the
  rest are taken round-robin; while an agent that holds it warm is
  connected, the job waits for it up to ``warm_wait_seconds`` before it goes
  to a cold one (the dispatcher's rule: it needs the job's wait);
- only when no free device anywhere takes a job may it be held ready on a
  busy device (prefetch, protocol 6: one per device, started when the device
  frees), warm agents first, cold ones only for a model warm nowhere;
- an agent reserved for a multi-GPU shape (its next job waited past
  ``reserve_after_seconds``) gives its devices to that shape alone, so
  single-GPU jobs cannot keep it from ever having enough free at once;
- quarantined devices (``gpuq.quarantine``) are not the agent's to give: a
  session's ``devices`` and free devices leave them out;
- a job whose last attempt failed on some devices goes to others when a
  lease's agents have enough free (``elsewhere``), else back to those.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import Protocol

from gpuq.jobs import Shape
from gpuq.protocol import PLACEMENT_SINCE, PREEMPT_SINCE, Device

ShapeKey = tuple[str, str]  # (kind, digest): Shape.key
NONE: Mapping[str, ShapeKey] = MappingProxyType({})


class Candidate(Protocol):
    """What placement reads of a connected agent (``dispatcher.AgentSession``)."""

    id: str
    kinds: frozenset[str]

    @property
    def version(self) -> int: ...
    @property
    def draining(self) -> bool: ...
    @property
    def labels(self) -> frozenset[str]: ...
    @property
    def models(self) -> frozenset[str]: ...
    @property
    def devices(self) -> tuple[Device, ...]: ...
    @property
    def free(self) -> int: ...
    def free_devices(self, min_memory_mb: int) -> list[int]: ...
    def ready_devices(self, min_memory_mb: int) -> list[int]: ...


def could_run(shape: Shape, agent: Candidate) -> bool:
    """Whether ``agent`` meets every hard requirement of ``shape``, free devices or not."""
    if shape.kind not in agent.kinds:
        return False
    if shape.plain:
        return True  # a limited kind's plain jobs: any agent of the kind, any version
    if shape.preemptible and agent.version < PREEMPT_SINCE:
        return False
    if agent.version < PLACEMENT_SINCE or not shape.labels <= agent.labels:
        return False
    return shape.gpus <= sum(d.memory_mb >= (shape.gpu_memory_mb or 0) for d in agent.devices)


def room(shape: Shape, agent: Candidate, reserved: Mapping[str, ShapeKey] = NONE, ready: bool = False) -> int:
    """How many of ``shape``'s jobs ``agent`` can start now; ``reserved``: agent id -> the shape
    whose jobs alone may take that agent's devices (a multi-GPU job that waited too long).
    ``ready``: how many it can hold ready instead, one per busy device, to start when it frees
    (prefetch; jobs without GPUs have theirs in ``free``)."""
    if agent.draining or not could_run(shape, agent):
        return 0
    if shape.gpus == 0:
        return 0 if ready else agent.free
    if reserved.get(agent.id, shape.key) != shape.key:
        return 0
    devices = agent.ready_devices if ready else agent.free_devices
    return len(devices(shape.gpu_memory_mb or 0)) // shape.gpus


def slots(shape: Shape, agents: Iterable[Candidate], limit: int, reserved: Mapping[str, ShapeKey] = NONE,
          warm_only: bool = False, ready: bool = False) -> list[str]:
    """Agent ids, one per job to lease now, at most ``limit``: warm agents first, each round-robin
    (``warm_only``: none of the others; ``ready``: to hold ready on busy devices)."""
    warm: list[list[str]] = []
    cold: list[list[str]] = []
    for agent in agents:
        if n := room(shape, agent, reserved, ready):
            (warm if holds_warm(shape, agent) else cold).append([agent.id] * n)
    return (_round_robin(warm) + ([] if warm_only else _round_robin(cold)))[:limit]


def holds_warm(shape: Shape, agent: Candidate) -> bool:
    return shape.model is not None and shape.model in agent.models


def warm_somewhere(shape: Shape, agents: Iterable[Candidate]) -> bool:
    """Whether an agent that could run ``shape``'s jobs holds its model warm, busy or not: then
    they may wait a little for it (``warm_wait_seconds``) before going to a cold one."""
    return any(holds_warm(shape, a) and not a.draining and could_run(shape, a) for a in agents)


def reserve(shape: Shape, agents: Iterable[Candidate], taken: Iterable[str]) -> str | None:
    """The agent to keep for ``shape``'s jobs as it drains: of those that could run them and are not
    ``taken`` (reserved already), the one with the most fitting devices free (the nearest to fit)."""
    taken = set(taken)
    fits = [a for a in agents if a.id not in taken and not a.draining and could_run(shape, a)]
    if not fits:
        return None
    return max(fits, key=lambda a: len(a.free_devices(shape.gpu_memory_mb or 0))).id


class Retried(Protocol):
    """What ``elsewhere`` reads of a leased job (``jobs.LeasedJob``)."""

    @property
    def id(self) -> int: ...
    @property
    def leased_by(self) -> str: ...
    @property
    def failed_devices(self) -> tuple[str, ...]: ...  # 'agent:index' of the devices its last attempt failed on


def elsewhere(jobs: Sequence[Retried], slots: Sequence[str], free: Mapping[str, Sequence[int]],
              names: Mapping[str, str], gpus: int) -> dict[int, str]:
    """Jobs of one lease whose last attempt failed on devices that the agent the lease chose would
    give them again, moved to an agent with ``gpus`` other ``free`` devices: job id -> that agent.
    ``slots``: the lease's (job i took slot i; the rest went unused); ``names``: agent id -> its
    name. Into an unused slot first, else in exchange with a job that may go anywhere; a job with
    nowhere else to go stays (it runs on those devices again rather than wait)."""
    def fits(job: Retried, sid: str) -> bool:
        avoid = set(job.failed_devices)
        return sum(f"{names.get(sid)}:{i}" not in avoid for i in free.get(sid, ())) >= gpus

    at = {j.id: j.leased_by for j in jobs}
    spare = list(slots[len(jobs):])
    for job in jobs:
        here = at[job.id]
        if not job.failed_devices or fits(job, here):
            continue
        if (n := next((n for n, sid in enumerate(spare) if sid != here and fits(job, sid)), None)) is not None:
            at[job.id], spare[n] = spare[n], here
            continue
        other = next((k for k in jobs if not k.failed_devices and at[k.id] != here and fits(job, at[k.id])), None)
        if other is not None:
            at[job.id], at[other.id] = at[other.id], here
    return {j.id: at[j.id] for j in jobs if at[j.id] != j.leased_by}


def _round_robin(columns: Sequence[list[str]]) -> list[str]:
    return [sid for row in itertools.zip_longest(*columns) for sid in row if sid is not None]


def why_unplaceable(shape: Shape, agents: Sequence[Candidate]) -> str | None:
    """Why no connected agent could ever run ``shape``'s jobs (None: one could)."""
    if any(could_run(shape, a) for a in agents):
        return None
    takers = [a for a in agents if shape.kind in a.kinds]
    if not takers:
        return f"no connected agent takes kind {shape.kind}"
    takers = [a for a in takers if a.version >= PLACEMENT_SINCE]
    if not takers:
        return f"no agent taking {shape.kind} speaks protocol {PLACEMENT_SINCE} (older agents get plain jobs only)"
    if shape.preemptible and not (takers := [a for a in takers if a.version >= PREEMPT_SINCE]):
        return f"no agent taking {shape.kind} speaks protocol {PREEMPT_SINCE} (older agents cannot yield preemptible jobs)"
    labelled = [a for a in takers if shape.labels <= a.labels]
    if not labelled:
        return f"no agent taking {shape.kind} has the labels {', '.join(sorted(shape.labels))}"
    memory = f" of at least {shape.gpu_memory_mb} MiB" if shape.gpu_memory_mb else ""
    return f"no agent taking {shape.kind} with those labels has {shape.gpus} GPUs{memory}"
