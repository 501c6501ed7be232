"""What one agent connection holds and may take: credit, devices, usage. No I/O, no frames.

``ServerProtocol`` owns one ``Ledger`` (``proto.ledger``) and keeps it
current from the frames it accepts; the dispatcher reads it to choose what
to push. The rules of the account (docs/protocol.md, "Dispatch"):

- credit: ``capacity`` minus the jobs held without devices, none before the
  hello nor once the agent drains or the connection closes (``stop``);
- version 5: ``prefetch`` more jobs without devices than ``capacity`` may be
  held (the agent keeps them ready for its next free slot); the agent says
  which jobs it ``started``; a held job never said started is *unstarted*:
  it goes back without counting its attempt when the agent leaves, or at once
  when the agent gives it back (``release``); before version 5 every pushed
  job counts as started;
- version 4: a job pushed with devices takes those devices instead of credit
  (``free_devices``); version 6 with ``prefetch``: a device that runs one held
  job may be given one more, which starts when it frees (``ready_devices``);
- an outcome whose token matches a held job frees its credit or its devices
  (``settle``); any other outcome frees nothing;
- ``held_models``: the model each held job named, until its outcome or its
  release (placement counts it warm there: the job runs with it loaded or
  loading);
- version 7: a batch (``hold_batch``: jobs the agent runs in one handler call)
  takes one credit, or its devices once, like one job, while any of its
  items is held; held ready, it is one ready job; it is given only to an agent
  whose hello took batches of that size (``batch``), and numbered here;
- ``usage`` is each device's last reported usage (only devices the hello
  named); ``busy`` sums the slots' reports of the last minute (version 6);
- a ``quarantined`` device (the server's quarantine of bad GPUs, issue #33) is
  given no new job, free or ready; what runs there finishes;
- a job pushed with devices to ``avoid`` (those its last attempt failed on)
  gets others when enough fit, else those.

``device_status`` presents the devices for /status and the dashboard.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

from gpuq.protocol.codes import BATCH_SINCE, PREFETCH_SINCE, SLOTS_SINCE
from gpuq.protocol.describe import Device, DeviceUsage
from gpuq.protocol.messages import Hello, Outcome
from gpuq.protocol.slots import BusyWindow

UNKNOWN_KIND = "?"  # the kind given with an outcome for a job this connection does not hold


class Ledger:
    """The jobs one agent connection holds, and the credit and devices it has left."""

    def __init__(self) -> None:
        self.capacity = 0  # the hello's: jobs without devices that may run at once
        self.prefetch = 0  # version 5: jobs without devices held ready beyond ``capacity``
        self.devices: tuple[Device, ...] = ()  # version 4: the GPUs the hello offered
        self.held: dict[int, tuple[str, str]] = {}  # job id -> (lease token, kind)
        self.devices_in_use: dict[int, tuple[int, ...]] = {}  # job id -> the devices it was pushed with
        self.started: set[int] = set()  # version 5: held jobs the agent said it started
        self.preemptible: set[int] = set()  # version 9: held jobs pushed with grace_seconds (they may be asked to yield)
        self.started_at: dict[int, float] = {}  # version 5: when the started came (the clock of receive)
        self.held_models: dict[int, str] = {}  # job id -> the model it named (placed jobs that name one)
        self.batch = 0  # version 7: the most jobs one batch may hold (0: no batches)
        self.batch_of: dict[int, int] = {}  # held job id -> the number of the batch it was pushed in
        self.batches: dict[int, set[int]] = {}  # batch number -> its held items
        self._batched_extra = 0  # held items without devices beyond one per batch: they take no credit
        self._last_batch = 0  # the last batch number given on this connection
        self.usage: dict[int, DeviceUsage] = {}  # device index -> its last reported usage
        self.quarantined: dict[int, str] = {}  # device index -> why it takes no new job (the server's quarantine)
        self.busy = BusyWindow()  # version 6: the agent's slot reports of the last minute
        self.taking = False  # between the hello and the drain (or the close)
        self._tracks_started = False  # version 5: else every pushed job starts at once
        self._ready_devices = False  # version 6 with prefetch: a busy device may take one job ready

    def open(self, hello: Hello) -> None:
        """The agent's hello came: its capacity, prefetch and devices; credit from now on."""
        self.capacity = hello.capacity
        self.prefetch = hello.prefetch if hello.protocol >= PREFETCH_SINCE else 0
        self.devices = hello.devices
        self._tracks_started = hello.protocol >= PREFETCH_SINCE
        self._ready_devices = hello.protocol >= SLOTS_SINCE and self.prefetch > 0
        self.batch = hello.batch if hello.protocol >= BATCH_SINCE else 0
        self.taking = True

    def stop(self) -> None:
        """No more jobs (the agent drains, or the connection closed); what is held stays held."""
        self.taking = False

    # -- what may be given -------------------------------------------------------

    @property
    def free(self) -> int:
        """Jobs without devices this connection may be given now."""
        if not self.taking:
            return 0
        plain_units = len(self.held) - len(self.devices_in_use) - self._batched_extra
        return max(0, self.capacity + self.prefetch - plain_units)

    def free_devices(self, min_memory_mb: int = 0) -> list[int]:
        """Indices of the devices no held job was given, with at least ``min_memory_mb`` (none while
        draining)."""
        if not self.taking:
            return []
        used = {i for given in self.devices_in_use.values() for i in given}
        return [d.index for d in self.devices
                if d.index not in used and d.index not in self.quarantined and d.memory_mb >= min_memory_mb]

    def ready_devices(self, min_memory_mb: int = 0) -> list[int]:
        """Version 6, ``prefetch`` on: indices of the devices that run one held job and have none
        waiting, with at least ``min_memory_mb``: each may take one job to start when it frees."""
        if not self.taking or not self._ready_devices:
            return []
        given = Counter(i for _, devices in self._device_units() for i in devices)
        return [d.index for d in self.devices
                if given[d.index] == 1 and d.index not in self.quarantined and d.memory_mb >= min_memory_mb]

    # -- what is held ------------------------------------------------------------

    def holds(self, job_id: int, lease_token: str) -> bool:
        """Whether this connection holds the job with that lease token."""
        entry = self.held.get(job_id)
        return entry is not None and entry[0] == lease_token

    def unstarted(self) -> list[int]:
        """Held jobs the agent never said it started (version 5; before it, every job starts at once)."""
        if not self._tracks_started:
            return []
        return [i for i in self.held if i not in self.started]

    def started_ids(self) -> list[int]:
        """Held jobs that started: whose attempt counts if the connection ends now."""
        return list(self.started) if self._tracks_started else list(self.held)

    def device_jobs(self) -> tuple[dict[int, int], dict[int, int]]:
        """Device index -> the held job running there, and -> the one waiting for it (version 6
        prefetch; before version 5 every pushed job counts as running)."""
        running: dict[int, int] = {}
        waiting: dict[int, int] = {}
        for job_id, given in self._device_units():
            started = job_id in self.started or not self._tracks_started
            for i in given:
                (running if started else waiting)[i] = job_id
        return running, waiting

    def _device_units(self) -> Iterator[tuple[int, tuple[int, ...]]]:
        """``(job id, devices)`` of each held unit with devices: a batch once, by one of its items."""
        seen: set[int] = set()
        for job_id, devices in self.devices_in_use.items():
            number = self.batch_of.get(job_id)
            if number is not None:
                if number in seen:
                    continue
                seen.add(number)
            yield job_id, devices

    # -- changes -----------------------------------------------------------------

    def hold(self, job_id: int, lease_token: str, kind: str, gpus: int = 0, min_memory_mb: int = 0,
             model: str | None = None, avoid: frozenset[int] = frozenset()) -> tuple[int, ...] | None:
        """Hold a job being pushed: it takes credit, or ``gpus`` devices of at least ``min_memory_mb``
        (free ones, else ready ones: it starts when they free), those not in ``avoid`` first. The
        devices it was given; None, and nothing held, when there are not enough."""
        devices: tuple[int, ...] = ()
        if gpus:
            free = self.free_devices(min_memory_mb)
            if len(free) < gpus:
                free = self.ready_devices(min_memory_mb)  # to start when they free
            if len(free) < gpus:
                return None
            devices = tuple(sorted(free, key=lambda i: i in avoid)[:gpus])  # stable: in index order
        self._keep(job_id, lease_token, kind, devices, model)
        return devices

    def hold_batch(self, items: Sequence[tuple[int, str]], kind: str, gpus: int = 0, min_memory_mb: int = 0,
                   model: str | None = None) -> tuple[tuple[int, ...], int] | None:
        """Hold the items ``(id, lease_token)`` of one batch being pushed, as one job: one credit, or
        ``gpus`` devices for all of them. Its devices and its number on this connection; None, and
        nothing held, when the agent takes no batch that large or the devices are not there."""
        if not 0 < len(items) <= self.batch:
            return None
        (first, token), rest = items[0], items[1:]
        devices = self.hold(first, token, kind, gpus, min_memory_mb, model)
        if devices is None:
            return None
        self._last_batch += 1
        number = self._last_batch
        for job_id, lease_token in rest:
            self._keep(job_id, lease_token, kind, devices, model)
        if not devices:
            self._batched_extra += len(rest)
        self.batch_of.update((job_id, number) for job_id, _ in items)
        self.batches[number] = {job_id for job_id, _ in items}
        return devices, number

    def _keep(self, job_id: int, lease_token: str, kind: str, devices: tuple[int, ...], model: str | None) -> None:
        if job_id in self.held:  # leased again (its old lease expired): the old hold, and its batch, go
            self._drop(job_id)
        self.held[job_id] = (lease_token, kind)
        if devices:
            self.devices_in_use[job_id] = devices
        if model is not None:
            self.held_models[job_id] = model

    def _drop(self, job_id: int) -> bool:
        """Forget a held job; whether that freed its credit or devices (a batch's: with its last item)."""
        del self.held[job_id]
        had_devices = self.devices_in_use.pop(job_id, None) is not None
        self.held_models.pop(job_id, None)
        self.started.discard(job_id)
        self.preemptible.discard(job_id)
        self.started_at.pop(job_id, None)
        number = self.batch_of.pop(job_id, None)
        if number is None:
            return True
        items = self.batches[number]
        items.discard(job_id)
        if not items:
            del self.batches[number]
            return True
        if not had_devices:
            self._batched_extra -= 1
        return False

    def settle(self, outcomes: Iterable[Outcome],
               now: float = 0.0) -> tuple[list[tuple[Outcome, str]], int, dict[int, float]]:
        """Free the credit (or devices) of each held job whose token matches: each outcome with its
        job's kind (``UNKNOWN_KIND`` when not held here), how many credits (or jobs' devices) were
        freed (a batch's with its last outcome), and how long each job said started ran until ``now``
        (version 5: its handler's run time, a prefetched job's wait not in it). Any other outcome
        still goes to the database (a resend after a reconnect can land): the token decides."""
        held, items, freed, ran = self.held, [], 0, {}
        for msg in outcomes:
            entry = held.get(msg.id)
            if entry is not None and entry[0] == msg.lease_token:
                if (at := self.started_at.get(msg.id)) is not None:
                    ran[msg.id] = max(0.0, now - at)
                freed += self._drop(msg.id)
                items.append((msg, entry[1]))
            else:
                items.append((msg, UNKNOWN_KIND))
        return items, freed, ran

    def mark_started(self, ids: Iterable[int], now: float = 0.0) -> None:
        """The agent started these jobs (version 5), told at ``now``; another connection's ids:
        nothing to track."""
        held, started, at = self.held, self.started, self.started_at
        for i in ids:
            if i in held and i not in started:
                started.add(i)
                at[i] = now

    def release(self, ids: Iterable[int]) -> tuple[tuple[int, str], ...]:
        """Give back held jobs the agent never started, as ``(id, lease_token)``; a started one stays
        (its outcome will come). A batch frees its credit (or devices) with its last item."""
        back = []
        for i in ids:
            if i in self.held and i not in self.started:
                back.append((i, self.held[i][0]))
                self._drop(i)
        return tuple(back)

    def record_usage(self, usage: Iterable[DeviceUsage]) -> None:
        """The devices' latest usage; indices the hello did not name are ignored."""
        known = {d.index for d in self.devices}
        self.usage.update((u.index, u) for u in usage if u.index in known)


def failed_here(job: Any, hello: Hello | None) -> frozenset[int]:
    """The devices of the agent that said ``hello`` (by its name) that the job's last attempt failed
    on (``failed_devices``: 'agent:index', the server's record): the ones ``hold`` gives it last."""
    failed = getattr(job, "failed_devices", ())
    if not failed or hello is None:
        return frozenset()
    return frozenset(int(index) for agent, _, index in (f.rpartition(":") for f in failed)
                     if agent == hello.agent and index.isdigit())


def avoiding_first(units: list[list[Any]]) -> list[list[Any]]:
    """Pushed units in the order their devices are chosen: those with devices to avoid first, so a
    job that may go anywhere does not take the one device another must not get again."""
    if not any(getattr(unit[0], "failed_devices", None) for unit in units):
        return units
    return sorted(units, key=lambda unit: not getattr(unit[0], "failed_devices", None))


def device_status(ledger: Ledger) -> list[dict[str, Any]]:
    """Each device the agent offers, as /status and the dashboard show it: its memory, its last
    reported usage, the held job running there (``job``), the one waiting for it (``next``) and
    why it is quarantined (``quarantined``: None when it is not)."""
    running, waiting = ledger.device_jobs()
    out = []
    for d in ledger.devices:
        usage = ledger.usage.get(d.index)
        out.append({"index": d.index, "name": d.name, "memory_mb": d.memory_mb,
                    "memory_used_mb": usage.memory_used_mb if usage else None,
                    "utilization": usage.utilization if usage else None,
                    "job": running.get(d.index), "next": waiting.get(d.index),
                    "quarantined": ledger.quarantined.get(d.index)})
    return out
