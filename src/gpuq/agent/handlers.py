"""The user's handler: what it gets (``Job``), how it fails (``PermanentError``, ``DeviceError``,
and the text stored for a failure), and loading one named ``module:function``."""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable, Iterable
from contextvars import ContextVar
from typing import Any

from gpuq import protocol
from gpuq.protocol.agent_side import AgentProtocol

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
class DeviceError(Exception):
    """Raise from a handler when the job's GPU is bad, not the job: the attempt fails (retried, on
    another device when one fits) and the agent reports the device to the server (protocol 9),
    which quarantines it after repeated faults (``GPUQ_QUARANTINE_FAULTS``). ``devices``: which of
    ``job.devices`` (indices as there; default: all of the job's)."""

    def __init__(self, message: str = "device error", devices: Iterable[int] | None = None):
        super().__init__(message)
        self.devices = None if devices is None else tuple(devices)


def report_fault(protocol: AgentProtocol, job: Job, exc: BaseException) -> None:
    """If ``exc`` is a ``DeviceError``, tell the server which of the job's devices are bad (before
    the job's outcome, so the server counts the fault before the devices are free again)."""
    if not isinstance(exc, DeviceError):
        return
    devices = job.devices if exc.devices is None else tuple(i for i in exc.devices if i in job.devices)
    protocol.device_fault(devices, "handler", str(exc) or type(exc).__name__, job.id)


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
