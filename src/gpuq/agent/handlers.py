"""The user's handler: what it gets (``Job``), how it fails (``PermanentError``, and the text
stored for a failure), and loading one named ``module:function``."""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from contextvars import ContextVar
from typing import Any

from gpuq import protocol

# What a handler gets: job.id, job.kind, job.payload, job.attempt, job.lease_token
# (the protocol's own message object, so a push is parsed into it only once).
Job = protocol.JobMessage


Handler = Callable[[Job], Any]

# The error the agent reports for an attempt it stopped: at the job's timeout (retryable), or
# because the server cancelled the job (not retryable; the server has already ended it).
TIMEOUT_ERROR = "timeout"
CANCELLED_ERROR = "cancelled"


class PermanentError(Exception):
    """Raise from a handler for a failure that retrying cannot fix: the job goes dead."""


class JobPreempted(Exception):
    """Raise from a handler that stops because ``job.preempted`` is set (after saving a checkpoint):
    the job goes back to pending, its attempt not counted. Any exception raised once the job is
    preempted counts the same; a handler that returns a result finished, and its result is kept."""


# The job a handler runs in this task (async handlers): ``run_process`` stops its child when it is preempted.
current_job: ContextVar[Job | None] = ContextVar("gpuq_current_job", default=None)


class HandlerError(ValueError):
    """A handler named ``module:function`` that cannot be loaded (one line for the operator)."""


def load_handler(spec: str) -> Callable[..., Any]:
    """The callable ``spec`` (``module:function``) names, imported."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise HandlerError(f"handler {spec!r} must look like module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise HandlerError(f"cannot import handler module {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise HandlerError(f"{spec!r}: {module_name} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def summary(exc: BaseException, limit: int = 4000) -> str:
    """The exception and the last frames of its traceback, short enough to store."""
    text = "".join(traceback.format_exception(exc, limit=-5))
    return text[-limit:]
