"""gpuq: an event-driven GPU job queue on PostgreSQL.

The producer helpers load lazily: ``import gpuq.agent`` on a GPU box must not
pull in asyncpg and the database side.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from gpuq.jobs import NewJob
    from gpuq.producer import (
        JobCancelled,
        JobDead,
        JobError,
        WaitTimeout,
        cancel,
        enqueue,
        enqueue_many,
        preempt,
        show,
        wait,
    )

__all__ = ["JobCancelled", "JobDead", "JobError", "NewJob", "WaitTimeout", "cancel", "enqueue", "enqueue_many",
           "preempt", "show", "wait"]
__version__ = "0.1.0"

_LAZY = {"NewJob": "gpuq.jobs", **dict.fromkeys(
    ("enqueue", "enqueue_many", "cancel", "preempt", "show", "wait", "JobError", "JobDead", "JobCancelled", "WaitTimeout"),
    "gpuq.producer")}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'gpuq' has no attribute {name!r}")
