"""Batches (protocol 7): the jobs of one push that run in one handler call. No I/O, no frames.

The rules of a batch on the wire (docs/protocol.md, "Batches"):

- the jobs of one ``jobs`` frame with the same ``batch`` number form one batch;
- its items are consecutive in the frame, all of one kind, all with the same
  ``devices``, and at most ``hello.batch`` of them;
- an agent that said ``batch`` 0 (or speaks an earlier version) is never sent one.

``check_batches`` applies them to a push, on the agent's side, before anything
of it is kept: a push that breaks one is a ``ProtocolError`` (``bad_message``).
``units`` turns a push's jobs into what a slot runs: a single job, or a
``Batch``. ``group`` is the server's side: jobs to push, batched ones together.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gpuq.protocol.codes import ErrorCode, ProtocolError
from gpuq.protocol.messages import JobMessage

__all__ = ["Batch", "Unit", "check_batches", "group", "job_ids", "units"]


@dataclass(eq=False, slots=True)
class Batch:
    """Jobs that run in one batch handler call, in one slot (or on one set of devices).

    ``id`` names it in the slots' count: its first item's id when pushed (job
    ids are unique, so no single job has it). ``jobs`` shrinks when an item
    is cancelled before the batch starts.
    """

    number: int
    jobs: list[JobMessage]
    id: int = field(init=False)

    def __post_init__(self) -> None:
        self.id = self.jobs[0].id

    @property
    def kind(self) -> str:
        return self.jobs[0].kind

    @property
    def devices(self) -> tuple[int, ...]:
        return self.jobs[0].devices

    @property
    def queued_ms(self) -> int | None:
        """The longest any item had been due: the batch was runnable from then on."""
        return max((j.queued_ms for j in self.jobs if j.queued_ms is not None), default=None)

    @property
    def timeout(self) -> float | None:
        """The batch runs under its items' smallest timeout (None when none has one)."""
        return min((j.timeout for j in self.jobs if j.timeout is not None), default=None)


Unit = JobMessage | Batch  # what one slot runs at a time


def job_ids(unit: Unit) -> list[int]:
    """The job ids a unit holds."""
    return [j.id for j in unit.jobs] if isinstance(unit, Batch) else [unit.id]


def check_batches(jobs: Sequence[JobMessage], max_items: int) -> None:
    """The rules of a batch for a push to an agent that takes up to ``max_items`` jobs per batch
    call (0: none), or ``ProtocolError`` (``bad_message``) saying which one it breaks."""
    seen: set[int] = set()
    previous: JobMessage | None = None
    size = 0
    for job in jobs:
        number = job.batch
        if number is None:
            previous = None
            continue
        if not max_items:
            raise _bad(f"job {job.id} comes in batch {number}, but this agent takes no batches (hello.batch 0)")
        if previous is None or previous.batch != number:
            if number in seen:
                raise _bad(f"batch {number} is split: its items must be consecutive in the frame")
            seen.add(number)
            size = 0
        elif job.kind != previous.kind or job.devices != previous.devices:
            raise _bad(f"batch {number} mixes kinds or devices: its items must share both")
        size += 1
        if size > max_items:
            raise _bad(f"batch {number} has more than {max_items} items (hello.batch)")
        previous = job


def _bad(message: str) -> ProtocolError:
    return ProtocolError(ErrorCode.BAD_MESSAGE, f"jobs: {message}")


def units(jobs: Iterable[JobMessage]) -> list[Unit]:
    """A push's jobs as slots run them: each single job, and each batch (its items consecutive:
    ``check_batches`` held) as one ``Batch``."""
    out: list[Unit] = []
    for job in jobs:
        last = out[-1] if out else None
        if job.batch is None:
            out.append(job)
        elif isinstance(last, Batch) and last.number == job.batch:
            last.jobs.append(job)
        else:
            out.append(Batch(job.batch, [job]))
    return out


def group(jobs: Iterable[Any]) -> list[list[Any]]:
    """The server's side: leased jobs as pushed, in order of first appearance, each job alone and
    the jobs with the same ``batch`` attribute together (so a batch's items are consecutive)."""
    out: list[list[Any]] = []
    batches: dict[Any, list[Any]] = {}
    for job in jobs:
        key = getattr(job, "batch", None)
        if key is None:
            out.append([job])
        elif key in batches:
            batches[key].append(job)
        else:
            batches[key] = [job]
            out.append(batches[key])
    return out
