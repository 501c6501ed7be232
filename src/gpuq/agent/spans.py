"""The handler's span (``gpuq[otel]``, docs/design.md "Tracing"): a job that carries its producer's
trace runs inside ``run {kind}``, a consumer span that continues it, current while the handler
runs (the handler's own spans, and the jobs it enqueues, are its children).

A batch runs in one span: its parent is the first traced item's producer span, and it links to
every traced item's (one call, one span; each item's outcome is on the server's completion span).

The slots call the ``traced`` handler only for a job with a trace (``job.trace``), and the
``traced_batch`` one for every batch; without OpenTelemetry there are none (the slots call the
handlers themselves), and with it but no tracer provider configured they call the handler after
one test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from gpuq import tracing
from gpuq.agent.batches import BatchHandler
from gpuq.agent.handlers import Handler, Job
from gpuq.protocol.agent_side import AgentProtocol

STOPPED = "stopped (timeout or cancel)"  # the status of a handler's span that was asked to stop


def traced(get: Callable[[], Handler | None], protocol: AgentProtocol, is_async: bool) -> Handler | None:
    """The handler ``get()`` returns (the slots' own, which may be replaced) run inside its job's
    span, for jobs that carry a trace; None without OpenTelemetry."""
    if not tracing.AVAILABLE:
        return None
    if is_async:
        async def run_async(job: Job) -> Any:
            handler = get()
            assert handler is not None  # the slots call it for jobs that have a handler
            if not tracing.recording():
                return await handler(job)
            with _span([job], protocol):
                return await handler(job)
        return run_async

    def run(job: Job) -> Any:
        handler = get()
        assert handler is not None
        if not tracing.recording():
            return handler(job)
        with _span([job], protocol):
            return handler(job)
    return run


def traced_batch(get: Callable[[], BatchHandler | None], protocol: AgentProtocol,
                 is_async: bool) -> BatchHandler | None:
    """The batch handler ``get()`` returns, run inside one span per batch when any item carries a
    trace; None without OpenTelemetry."""
    if not tracing.AVAILABLE:
        return None
    if is_async:
        async def run_async(jobs: list[Job]) -> Any:
            handler = get()
            assert handler is not None  # a batch comes only to an agent with a batch handler
            if all(j.trace is None for j in jobs) or not tracing.recording():
                return await handler(jobs)
            with _span(jobs, protocol):
                return await handler(jobs)
        return run_async

    def run(jobs: list[Job]) -> Any:
        handler = get()
        assert handler is not None
        if all(j.trace is None for j in jobs) or not tracing.recording():
            return handler(jobs)
        with _span(jobs, protocol):
            return handler(jobs)
    return run


@contextlib.contextmanager
def _span(jobs: Sequence[Job], protocol: AgentProtocol) -> Iterator[None]:
    """The span of one handler call: a single job's, or a batch's (links to its items' traces).
    A handler stopped (its timeout, a cancel) ends it with an error status, as one that raised."""
    traced = [j for j in jobs if j.trace is not None]
    first = traced[0]
    batch = len(jobs) > 1 or first.batch is not None
    with tracing.tracer().start_as_current_span(
            f"run {first.kind}", context=tracing.parent(first.trace),  # type: ignore[arg-type]
            kind=tracing.SpanKind.CONSUMER, attributes=_attributes(jobs, protocol, batch),
            links=[tracing.link(j.trace, {"gpuq.job.id": j.id})  # type: ignore[arg-type]
                   for j in traced] if batch else None) as span:
        try:
            yield
        except BaseException as exc:
            if not isinstance(exc, Exception):  # cancelled: the span records only Exceptions itself
                tracing.set_error(span, STOPPED)
            raise
        if any(j.cancelled for j in jobs):  # a sync handler asked to stop
            tracing.set_error(span, STOPPED)


def _attributes(jobs: Sequence[Job], protocol: AgentProtocol, batch: bool) -> dict[str, Any]:
    first = jobs[0]
    attributes: dict[str, Any] = {"messaging.system": tracing.SYSTEM, "messaging.operation.type": "process",
                                  "gpuq.job.kind": first.kind, "gpuq.agent": protocol.agent_id or protocol.hello.agent}
    if batch:
        attributes.update({"gpuq.batch.size": len(jobs), "gpuq.job.ids": [j.id for j in jobs]})
    else:
        attributes.update({"gpuq.job.id": first.id, "gpuq.job.attempt": first.attempt})
    if first.devices:
        attributes["gpuq.devices"] = list(first.devices)
    return attributes
