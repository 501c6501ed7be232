"""The notifications gpuq sends and the wake-up handshake that decides when producers send them.

The channels and their payload grammar (built and parsed here, and by the
trigger of migration 0005 and the statements of ``sql/queries.sql``):

- ``gpuq_jobs`` (``NOTIFY_CHANNEL``), to the dispatchers: ``+`` (inserted
  while a dispatcher waits), ``kind@priority`` (inserted above a lease
  floor), ``kind!`` (moved back to pending, behind any cursor), ``kind``,
  ``*`` (anything, anywhere), ``cancel:ID,...`` (``CANCEL_PREFIX``: stop
  these leased jobs), ``preempt:GRACE:ID,...`` (``PREEMPT_PREFIX``, from
  ``gpuq.preempt()``: these leased jobs must yield within GRACE seconds), or
  ``quarantine:AGENT`` (``QUARANTINE_PREFIX``: the quarantine of that agent's
  devices changed, migration 0022);
- ``gpuq_outcomes`` and ``gpuq_progress``, to ``gpuq.wait``: comma-joined ids.

The handshake (docs/design.md, "Wake-ups"): a dispatcher arms the wake-up
mark before it waits, waits for the stragglers, and records its lease floors.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpuq.sql import DB, queries

NOTIFY_CHANNEL = "gpuq_jobs"  # also in queries.sql (notify) and the trigger of migration 0001
OUTCOMES_CHANNEL = "gpuq_outcomes"  # job ids that ended (done, dead, cancelled): what gpuq.wait listens to
PROGRESS_CHANNEL = "gpuq_progress"  # job ids whose progress was written: what gpuq.wait(on_progress=) listens to
CANCEL_PREFIX = "cancel:"  # gpuq.cancel() announces leased jobs it cancelled: 'cancel:41,42'
PREEMPT_PREFIX = "preempt:"  # gpuq.preempt() asks leased jobs to yield: 'preempt:30:41,42' (30 s of grace)
QUARANTINE_PREFIX = "quarantine:"  # a device of that agent was quarantined or cleared: 'quarantine:box-1'
_IDS_PER_NOTIFY = 300  # ids of up to 19 digits stay under NOTIFY's 8000-byte payload
_MAX_KINDS_PAYLOAD = 7000  # longer lists of kinds go as '*'


# -- the grammar -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Wakeup:
    """A parsed notification: ``kinds`` -> the top priority inserted, or None when the jobs may
    be behind a cursor (moved back to pending, or an old payload); ``every``: any kind may have
    new jobs ('+', '*'); ``rewind``: and they may be behind any cursor ('*')."""

    kinds: dict[str, int | None]
    every: bool = False
    rewind: bool = False


def parse_wakeup(payload: str) -> Wakeup:
    """``+`` (inserted while a dispatcher waits, migration 0005), ``kind@priority`` (inserted
    above a lease floor), ``kind!`` (moved back), ``kind``, or ``*``."""
    if payload == "+":
        return Wakeup({}, every=True)
    if payload == "*" or not payload:
        return Wakeup({}, every=True, rewind=True)
    kinds: dict[str, int | None] = {}
    for entry in payload.split(","):
        kind, _, top = entry.rstrip("!").partition("@")
        priority = int(top) if top and not entry.endswith("!") else None
        previous = kinds.get(kind, priority)
        kinds[kind] = None if previous is None or priority is None else max(previous, priority)
    return Wakeup(kinds)


def parse_cancel(payload: str) -> list[int]:
    """The job ids of a ``cancel:ID,...`` notification (anything unreadable is skipped)."""
    return [int(i) for i in payload[len(CANCEL_PREFIX):].split(",") if i.isdigit()]


def parse_preempt(payload: str) -> tuple[float, list[int]]:
    """The grace seconds and job ids of a ``preempt:GRACE:ID,...`` notification (``ValueError`` for a
    grace that is not a number; unreadable ids are skipped)."""
    grace, _, ids = payload[len(PREEMPT_PREFIX):].partition(":")
    return float(grace), [int(i) for i in ids.split(",") if i.isdigit()]


def kinds_payload(kinds: Iterable[str], behind: bool = False) -> str:
    """The ``gpuq_jobs`` payload that wakes the dispatchers for ``kinds`` (``kind!`` if ``behind``),
    or ``*`` when the list would not fit."""
    payload = ",".join(k + "!" if behind else k for k in sorted(set(kinds)))
    return payload if len(payload) <= _MAX_KINDS_PAYLOAD else "*"


def ids_payloads(ids: Sequence[int], prefix: str = "") -> list[str]:
    """``prefix`` + comma-joined ``ids``, in as many payloads as NOTIFY's size limit needs."""
    return [prefix + ",".join(map(str, ids[i:i + _IDS_PER_NOTIFY])) for i in range(0, len(ids), _IDS_PER_NOTIFY)]


# -- sending -----------------------------------------------------------------


async def notify(db: DB, kinds: Iterable[str], behind: bool = False) -> None:
    """Wake the dispatchers for ``kinds``; ``behind``: the jobs went back to pending, behind
    any lease cursor (``kind!``), so the next lease of the kind starts from the top."""
    await db.execute(queries["notify"], kinds_payload(kinds, behind))


async def notify_outcomes(db: DB, ids: Sequence[int]) -> None:
    """Tell waiters these jobs ended (the completer's statements do it themselves)."""
    for payload in ids_payloads(ids):
        await db.execute(queries["notify_outcomes"], payload)


async def notify_cancel(db: DB, ids: Sequence[int]) -> None:
    """Tell the dispatchers holding these leased jobs to have their agents stop them."""
    for payload in ids_payloads(ids, CANCEL_PREFIX):
        await db.execute(queries["notify"], payload)


# -- the handshake -----------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Armed:
    """What ``arm_wakeups`` found: the server's clock and the wake-up mark before and after
    (epoch ms), and the transactions that may have inserted without seeing the new mark."""

    now_ms: int
    previous: int
    until: int
    stragglers: list[str]


async def arm_wakeups(db: DB, ttl_ms: int) -> Armed:
    """Ask producers to NOTIFY for the next ``ttl_ms`` (docs/design.md, "Wake-ups")."""
    row = await db.fetchrow(queries["arm_wakeups"], ttl_ms)
    return Armed(row["now_ms"], row["previous"], row["until"], list(row["stragglers"]))


async def insert_horizon(db: DB) -> tuple[int, list[str]]:
    """The highest job id drawn, and the transactions that must end before it is settled."""
    row = await db.fetchrow(queries["insert_horizon"])
    return row["last_id"], list(row["writers"])


async def stragglers_left(db: DB, xids: Sequence[str]) -> list[str]:
    """Those of the transactions ``xids`` that have not ended."""
    return list(await db.fetchval(queries["stragglers_left"], list(xids)))


async def set_floors(db: DB, dispatcher: int, floors: Mapping[str, int]) -> None:
    """Record the priorities the dispatcher's lease cursors reached: inserts above them notify."""
    await db.execute(queries["set_floors"], dispatcher, list(floors), list(floors.values()))


async def clear_floors(db: DB, dispatcher: int) -> None:
    """Drop a dispatcher's lease floors, and those of dispatchers that are gone."""
    await db.execute(queries["clear_floors"], dispatcher)
