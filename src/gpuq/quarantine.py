"""Quarantine of bad GPUs (issue #33): the policy, the device names and the statements over them.

A device is named ``AGENT:INDEX``: the agent's name (its hello's, the same
across its reconnects) and the index it gave the device. Agents report faults
(protocol 9, ``device_fault``): the handler's ``DeviceError``, and, where NVML
is present, Xid errors and uncorrectable ECC errors. The rule:

- a fault of the hardware (``xid``, ``ecc``) quarantines its device at once;
- ``DeviceError`` from a handler quarantines it at the ``faults``-th within
  ``window_seconds`` (``GPUQ_QUARANTINE_FAULTS``, 3, and
  ``GPUQ_QUARANTINE_WINDOW``, 10 minutes): one bad job must not take a GPU out;
- placement never gives a quarantined device new work (what runs there
  finishes); every server reads the quarantine from PostgreSQL when an agent
  connects and when a notification says it changed;
- an admin clears it (``gpuq device clear``, the dashboard), and with it the
  device's faults, so the count starts again.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gpuq.sql import DB, queries

SOURCES = ("handler", "xid", "ecc")  # what reported a fault: the handler's DeviceError, NVML
DEFAULT_FAULTS = 3
DEFAULT_WINDOW_SECONDS = 600.0
_DEVICE = re.compile(r"(?P<agent>[A-Za-z0-9_.:@-]{1,64}?)(?::(?P<index>\d{1,3}))?")


@dataclass(frozen=True, slots=True)
class Policy:
    """When handler faults quarantine a device: ``faults`` of them within ``window_seconds``."""

    faults: int = DEFAULT_FAULTS
    window_seconds: float = DEFAULT_WINDOW_SECONDS


def device_name(agent: str, index: int) -> str:
    return f"{agent}:{index}"


def parse_device(text: str) -> tuple[str, int | None]:
    """``AGENT:INDEX`` -> (agent, index); a bare ``AGENT`` -> (agent, None): every device of it.
    An agent name may hold ``:`` itself; a last part of digits is the index."""
    m = _DEVICE.fullmatch(text.strip())
    if m is None:
        raise ValueError(f"bad device {text!r}: expected AGENT:INDEX (the agent's name and the device's "
                         "index, as /status shows them) or AGENT")
    return m["agent"], None if m["index"] is None else int(m["index"])


async def record_fault(db: DB, agent: str, devices: list[int], source: str, error: str, job_id: int | None,
                       policy: Policy) -> dict[int, str]:
    """Record a fault on ``agent``'s ``devices``; those it quarantined now -> the reason."""
    rows = await db.fetch(queries["device_fault"], agent, devices, source, error, job_id, policy.faults,
                          policy.window_seconds)
    return {r["device"]: r["reason"] for r in rows}


async def of_agents(db: DB, agents: list[str]) -> dict[str, dict[int, str]]:
    """The quarantined devices of agents named ``agents``: name -> index -> reason."""
    out: dict[str, dict[int, str]] = {name: {} for name in agents}
    for r in await db.fetch(queries["quarantined_of"], agents):
        out[r["agent"]][r["device"]] = r["reason"]
    return out


async def listing(db: DB) -> list[dict[str, Any]]:
    """Every quarantined device, for ``/status``, ``gpuq device list`` and the dashboard."""
    return [{"device": device_name(r["agent"], r["device"]), "agent": r["agent"], "index": r["device"],
             "reason": r["reason"], "faults": r["faults"], "since": r["since"].isoformat()}
            for r in await db.fetch(queries["quarantined"])]


async def quarantine(db: DB, agent: str, index: int | None, reason: str) -> list[int]:
    """Quarantine a device by hand (``index`` None is refused: name one); the indices newly quarantined."""
    if index is None:
        raise ValueError("name the device to quarantine: AGENT:INDEX")
    reason = reason.strip() or "by an admin"
    return list((await db.fetchrow(queries["quarantine_set"], agent, [index], reason[:1024]))["added"])


async def clear(db: DB, agent: str, index: int | None) -> list[int]:
    """Clear the quarantine of ``agent``'s device ``index`` (None: all of its devices) and forget
    their faults; the indices that were quarantined."""
    row = await db.fetchrow(queries["quarantine_clear"], agent, None if index is None else [index])
    return list(row["cleared"])


# -- retry elsewhere: the devices a job failed on --------------------------------


async def record_failed_devices(db: DB, failed: list[tuple[int, str, tuple[str, ...]]]) -> None:
    """Jobs ``(id, lease_token, devices)`` failed on ``devices`` ('agent:index'): fenced by the lease
    like their outcome, written before it, so their next lease already knows."""
    if failed:
        await db.execute(queries["failed_devices"], [i for i, _, _ in failed], [t for _, t, _ in failed],
                         [",".join(d) for _, _, d in failed])


async def move_leases(db: DB, moves: list[tuple[int, str, str]]) -> None:
    """Leased jobs ``(id, lease_token, agent session)`` go to another agent than the lease chose."""
    if moves:
        await db.execute(queries["move_leases"], [i for i, _, _ in moves], [t for _, t, _ in moves],
                         [a for _, _, a in moves])
