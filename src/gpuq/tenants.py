"""Tenants and their fair share, as rules and numbers: no I/O (docs/design.md, "Fair share").

A job may name a tenant; one that names none belongs to the default tenant,
``default``. A tenant weighs 1 unless ``gpuq tenant set`` gave it a weight;
fair share is on while some tenant has one. Usage is GPU-seconds (run time
times GPUs, 1 slot for a CPU job), decayed with a half-life; the database
keeps it (``gpuq.tenant_usage``), ``gpuq.admin.tenants`` reads it.

Shares, as Slurm's ``sshare`` reports them: a tenant's ``share`` is its part
of the usage of every tenant listed, its ``fair_share`` the part its weight
entitles it to among the tenants with work or usage. Fair share holds when
the two agree.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from gpuq.kinds import is_kind

DEFAULT_TENANT = "default"
# The kind's rule (gpuq.kinds): the table's CHECKs are the same.
TENANT_RULE = "1-128 characters of A-Z a-z 0-9 _ . : / -"
MAX_WEIGHT = 1_000_000  # gpuq.tenants' CHECK: weight > 0 and at most this
# gpuq.fair_share_settings' CHECK: usage halves in 1 s at the least, in ~31 years at the most.
MIN_HALF_LIFE_SECONDS, MAX_HALF_LIFE_SECONDS = 1, 1_000_000_000


def is_tenant(value: object) -> bool:
    return is_kind(value)


def check_tenant(name: object) -> None:
    """A tenant's name (``ValueError``): the table's CHECK as a readable error."""
    if not is_tenant(name):
        raise ValueError(f"bad tenant {name!r}: {TENANT_RULE}")


def check_weight(weight: float) -> None:
    """A weight, more than 0 and at most MAX_WEIGHT (``ValueError``)."""
    if not 0 < weight <= MAX_WEIGHT:  # NaN fails too
        raise ValueError(f"a weight must be more than 0 and at most {MAX_WEIGHT}, not {weight}")


def check_half_life(seconds: float) -> None:
    """A half-life in seconds, MIN_HALF_LIFE_SECONDS to MAX_HALF_LIFE_SECONDS (``ValueError``)."""
    if not MIN_HALF_LIFE_SECONDS <= seconds <= MAX_HALF_LIFE_SECONDS:
        raise ValueError(f"the half-life must be {MIN_HALF_LIFE_SECONDS}-{MAX_HALF_LIFE_SECONDS} seconds, "
                         f"not {seconds}")


@dataclass(frozen=True, slots=True)
class Tenant:
    """One tenant as ``gpuq tenant``, ``/status``, ``/metrics`` and the dashboard show it."""

    name: str
    weight: float  # 1 unless set
    weighted: bool  # it has a row in gpuq.tenants
    usage: float  # GPU-seconds, decayed to now, with its running jobs' so far
    running: int  # jobs leased now
    pending: int  # counted up to backlog.COUNT_CAP
    share: float  # its part of the listed tenants' usage (0 when none has any)
    fair_share: float  # its weight's part among the tenants with work or usage (0 without either)

    def as_dict(self) -> dict[str, Any]:
        return {"tenant": self.name, "weight": self.weight, "weighted": self.weighted,
                "usage_gpu_seconds": round(self.usage, 3), "running": self.running, "pending": self.pending,
                "share": round(self.share, 4), "fair_share": round(self.fair_share, 4)}


def with_shares(rows: Iterable[Mapping[str, Any]]) -> list[Tenant]:
    """Tenants from the ``tenant_usage`` statement's rows, with their shares."""
    rows = list(rows)
    total_usage = sum(r["usage"] for r in rows)
    total_weight = sum(r["weight"] for r in rows if _active(r))
    return [Tenant(r["tenant"], r["weight"], r["weighted"], r["usage"], r["running"], r["pending"],
                   r["usage"] / total_usage if total_usage > 0 else 0.0,
                   r["weight"] / total_weight if _active(r) else 0.0)
            for r in rows]


def _active(row: Mapping[str, Any]) -> bool:
    """Has it work (running or pending) or usage? Only those share out the weights."""
    return bool(row["usage"] > 0 or row["running"] > 0 or row["pending"] > 0)
