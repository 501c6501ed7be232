"""The server's spans of traced jobs (``gpuq[otel]``, docs/design.md "Tracing").

A job that carries its producer's trace (``LeasedJob.trace``) gets two
spans here, children of its producer's span:

- ``lease {kind}`` (consumer): from the moment the dispatcher asked for the
  lease that took it (or, if later, the moment the job became due: never
  before its producer's span) to its push onto the agent's connection;
- ``complete {kind}``: from the start of the write of its outcome to its
  commit, with the outcome (``done``, ``retry``, ``dead``; ``rejected`` when
  fencing refused it).

Each has the job's id, kind and attempt and the agent (its ``leased_by``).
Without OpenTelemetry it costs one test per lease batch and per outcome flush;
installed, also a look at each leased job for a trace, and whether a tracer
provider is configured is asked only for a batch that has one. Nothing is
held, and no span made, unless one is. Traced jobs are held from their lease to their outcome;
one that never reports here (released, reclaimed) is forgotten when its agent
leaves, or with the rest once FOLLOWED are held (it only loses its
completion span).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any

from gpuq import tracing
from gpuq.jobs import FailOutcome, LeasedJob, error_line
from gpuq.protocol import Done, Failed

FOLLOWED = 100_000  # traced jobs held between their lease and their outcome, at most


@dataclass(frozen=True, slots=True)
class _Held:
    """What a traced job's completion span needs of its lease."""

    lease_token: str
    parent: Any  # the context of its producer's span
    attributes: dict[str, Any]


class ServerSpans:
    def __init__(self) -> None:
        self._held: dict[int, _Held] = {}  # traced job id -> its lease

    def lease_started(self) -> int:
        """When a lease begins (ns since the epoch); 0 without OpenTelemetry."""
        return time.time_ns() if tracing.AVAILABLE else 0

    def leased(self, jobs: Sequence[LeasedJob], started: int) -> None:
        """Jobs of a lease that began at ``started`` (``lease_started``) were pushed: a span for each
        traced one, which is held for its completion span, if a tracer provider records them
        (asked only then: it costs more than a look at each job)."""
        if not started:
            return
        traced = [j for j in jobs if j.trace is not None]
        if not traced or not tracing.recording():
            return
        tracer, now = tracing.tracer(), time.time_ns()
        if len(self._held) + len(traced) > FOLLOWED:
            self._held.clear()
        for j in traced:
            parent = tracing.parent(j.trace)  # type: ignore[arg-type]
            attributes = {"messaging.system": tracing.SYSTEM, "gpuq.job.id": j.id, "gpuq.job.kind": j.kind,
                          "gpuq.job.attempt": j.attempt, "gpuq.agent": j.leased_by}
            span = tracer.start_span(f"lease {j.kind}", context=parent, kind=tracing.SpanKind.CONSUMER,
                                     start_time=max(started, now - (j.queued_ms or 0) * 1_000_000), attributes={
                                         **attributes, "messaging.operation.type": "receive",
                                         "gpuq.job.queued_ms": j.queued_ms or 0})
            span.end(end_time=now)
            self._held[j.id] = _Held(j.lease_token, parent, attributes)

    def write_started(self) -> int:
        """When an outcome write begins (ns since the epoch); 0 while no traced job is held."""
        return time.time_ns() if self._held else 0

    def finished(self, started: int, done: Iterable[Done], failed: Iterable[Failed], accepted: AbstractSet[int],
                 outcomes: dict[int, FailOutcome]) -> None:
        """Outcomes written from ``started`` (``write_started``) to their commit: a span for each of
        a held job with the lease token it was held with."""
        if not started:
            return
        now, tracer = time.time_ns(), tracing.tracer()
        outcomes_written: list[Done | Failed] = [*done, *failed]
        for msg in outcomes_written:
            held = self._held.get(msg.id)
            if held is None or held.lease_token != msg.lease_token:
                continue
            del self._held[msg.id]
            outcome = _outcome(msg, accepted, outcomes)
            span = tracer.start_span(f"complete {held.attributes['gpuq.job.kind']}", context=held.parent,
                                     start_time=started, attributes={
                                         **held.attributes, "messaging.operation.type": "settle",
                                         "gpuq.job.outcome": outcome})
            if outcome != "done":
                tracing.set_error(span, error_line(msg.error) if isinstance(msg, Failed) and outcome != "rejected"
                                  else "the lease was no longer held (fencing refused the outcome)")
            span.end(end_time=now)

    def forget(self, ids: Iterable[int]) -> None:
        """Jobs that will not report here (their agent left)."""
        if self._held:
            for i in ids:
                self._held.pop(i, None)


def _outcome(msg: Done | Failed, accepted: AbstractSet[int], outcomes: dict[int, FailOutcome]) -> str:
    if isinstance(msg, Done):
        return "done" if msg.id in accepted else "rejected"
    out = outcomes.get(msg.id)
    if out is None:
        return "rejected"
    return "dead" if out.status == "dead" else "retry"
