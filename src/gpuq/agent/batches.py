"""A batch handler's contract: what it returns, and each item's outcome from it (protocol 7).

``f(jobs)`` gets the jobs of one batch, in order, and returns a list with one
entry per job: a JSON result, or an exception instance (that job alone fails,
retryable unless it is a ``PermanentError``). The rules, per item:

- raising fails every item (retryable unless ``PermanentError``);
- a list of the wrong length (or anything but a list) fails every item,
  permanently: a bug in the handler, which a retry would repeat;
- past the batch's timeout (its items' smallest) every item fails ``timeout``
  (retryable), whatever the handler returned;
- an item cancelled while its batch ran ends ``cancelled`` (not retryable) and
  its result is discarded; the other items' outcomes stand.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from gpuq.agent.handlers import (
    CANCELLED_ERROR,
    TIMEOUT_ERROR,
    DeviceError,
    Job,
    PermanentError,
    report_fault,
    summary,
)
from gpuq.protocol.agent_side import AgentProtocol
from gpuq.protocol.batches import Batch, Unit

BatchHandler = Callable[[list[Job]], Any]


def batch_jobs(unit: Unit) -> list[Job]:
    """The jobs a batch handler call gets for a unit: a batch's items, or a single job alone."""
    return list(unit.jobs) if isinstance(unit, Batch) else [unit]


def record_returned(protocol: AgentProtocol, jobs: Sequence[Job], returned: Any, expired: bool = False) -> None:
    """Each item's outcome from what the batch handler returned."""
    if expired:
        for job in jobs:
            protocol.job_failed(job, TIMEOUT_ERROR, retryable=True)
        return
    if not isinstance(returned, list) or len(returned) != len(jobs):
        got = f"a list of {len(returned)}" if isinstance(returned, list) else type(returned).__name__
        error = (f"the batch handler returned {got} for {len(jobs)} jobs: it must return a list with one "
                 "entry per job, in order")
        for job in jobs:
            protocol.job_failed(job, error, retryable=False)
        return
    if (fault := next((e for e in returned if isinstance(e, DeviceError)), None)) is not None:
        report_fault(protocol, jobs[0], fault)  # once: the items share their devices
    for job, entry in zip(jobs, returned, strict=True):
        if job.cancelled:
            protocol.job_failed(job, CANCELLED_ERROR, retryable=False)
        elif isinstance(entry, BaseException):
            protocol.job_failed(job, summary(entry), retryable=not isinstance(entry, PermanentError))
        else:
            protocol.job_done(job, entry)


def record_raised(protocol: AgentProtocol, jobs: Sequence[Job], exc: BaseException) -> None:
    """The batch handler raised: every item fails with it (a cancelled one as ``cancelled``)."""
    error, retryable = summary(exc), not isinstance(exc, PermanentError)
    report_fault(protocol, jobs[0], exc)  # once: the items share their devices
    for job in jobs:
        if job.cancelled:
            protocol.job_failed(job, CANCELLED_ERROR, retryable=False)
        else:
            protocol.job_failed(job, error, retryable)
