"""The agent's side of preemption (protocol 9): which held jobs must yield, and by when. No I/O.

``Yielding`` is part of ``AgentProtocol`` (``agent_side``), kept apart as its own concern:

- a ``preempt`` marks the named running jobs ``preempted`` with its deadline
  (the I/O layer stops their handlers then) and gives back (``release``) the
  named jobs that wait ready: they never start here;
- ``yield_running`` marks every running preemptible job (pushed with
  ``grace_seconds``) when the agent must leave (an interruption, SIGTERM),
  each by its grace, or sooner; from then on a push that crossed the drain
  goes back whole, none of it started (``leaving``);
- a job preempted already keeps its first deadline;
- ``job_preempted`` reports a job that yielded (``preempted``).
"""

from __future__ import annotations

from collections.abc import Callable

from gpuq.protocol.batches import Unit, job_ids
from gpuq.protocol.frames import encode
from gpuq.protocol.messages import JobMessage, Preempt, Preempted, mark_preempted


class Yielding:
    """Preemption's part of ``AgentProtocol`` (its state is the protocol's: the held jobs)."""

    running: dict[int, JobMessage]  # what AgentProtocol holds, as this part reads it
    clock: Callable[[], float]
    leaving = False  # yield_running was called: the agent must leave, and starts nothing new

    @property
    def waiting(self) -> list[Unit]:
        raise NotImplementedError

    def _give_back(self, units: list[Unit]) -> None:
        raise NotImplementedError

    def _finish(self, job: JobMessage, item: str) -> None:
        raise NotImplementedError

    def _preempt(self, msg: Preempt) -> Preempt:
        """Mark the named running jobs preempted, give back those that wait ready; the running ones."""
        named, deadline = set(msg.ids), self.clock() + msg.deadline_seconds
        self._give_back([unit for unit in self.waiting if named.intersection(job_ids(unit))])
        return Preempt(preempt_all([self.running[i] for i in msg.ids if i in self.running], lambda _: deadline),
                       msg.deadline_seconds)

    def yield_running(self, within: float | None = None) -> tuple[int, ...]:
        """The agent must leave (an interruption, SIGTERM): mark its running preemptible jobs preempted,
        each to yield within its grace, or ``within`` seconds if sooner; their ids."""
        now, self.leaving = self.clock(), True
        return preempt_all(list(self.running.values()), lambda job: None if job.grace_seconds is None else
                           now + (job.grace_seconds if within is None else min(within, job.grace_seconds)))

    def job_preempted(self, job: JobMessage) -> None:
        """The job yielded (version 9): back to pending, its attempt not counted."""
        self._finish(job, encode(Preempted(job.id, job.lease_token)))


def preempt_all(jobs: list[JobMessage], deadline: Callable[[JobMessage], float | None]) -> tuple[int, ...]:
    """Mark each job preempted, by ``deadline(job)`` (None: not this one; one preempted already keeps
    its deadline); the ids of those marked now or before."""
    marked = []
    for job in jobs:
        at = None if job.preempted else deadline(job)
        if at is not None:
            mark_preempted(job, at)
        if job.preempted:
            marked.append(job.id)
    return tuple(marked)


__all__ = ["Yielding", "preempt_all"]
