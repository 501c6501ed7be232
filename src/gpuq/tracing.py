"""OpenTelemetry traces of a job's path, with the optional extra ``gpuq[otel]`` (docs/design.md, "Tracing").

A job carries its producer's trace as a W3C ``traceparent`` (and ``tracestate``):
``gpuq.enqueue`` called with a span active stores it with the job (``enqueue_span``);
the server's lease and completion spans (``dispatcher/spans.py``) and the agent's
handler span (``agent/spans.py``) are its children, so one trace runs from the
producer to the outcome. Always the W3C format, whatever propagator the
application set: it is what the job stores and what the push carries.

The import is tried once, here. Without OpenTelemetry, ``AVAILABLE``,
``recording()`` and ``active()`` are False at once and nothing else runs;
with it but no tracer provider configured (the API's default), no span is
made and nothing stored unless the caller's context holds a span (one
propagated to it, say). Spans come from ``trace.get_tracer_provider()``, the
application's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any

from gpuq import __version__

if TYPE_CHECKING:
    from gpuq.jobs import TraceContext

try:
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.trace import SpanKind, Status, StatusCode
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the extra is not installed: no traces, no cost
    trace = None  # type: ignore[assignment]

AVAILABLE = trace is not None
_W3C = TraceContextTextMapPropagator() if AVAILABLE else None
SYSTEM = "gpuq"  # messaging.system on every span


def recording() -> bool:
    """Whether spans are worth making: OpenTelemetry is installed and the application configured a
    tracer provider (the SDK's), not the API's default that records nothing. ~1 µs (the API
    looks at the environment): asked for a job that carries a trace, not for every job."""
    if trace is None:
        return False
    return not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def active() -> bool:
    """Whether the caller's context holds a span (one it started, or one propagated to it)."""
    return trace is not None and trace.get_current_span().get_span_context().is_valid


def tracer() -> Any:
    """gpuq's tracer from the application's provider (asked each time: a provider set later counts)."""
    return trace.get_tracer("gpuq", __version__)


def current() -> TraceContext | None:
    """The caller's current span as ``(traceparent, tracestate)``; None when no span is active."""
    if not active():
        return None
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)  # type: ignore[union-attr]
    return carrier["traceparent"], carrier.get("tracestate") or None


def parent(trace_context: TraceContext) -> Context:
    """The context a job's span starts in: its producer's span as the (remote) parent."""
    traceparent, tracestate = trace_context
    carrier = {"traceparent": traceparent} if tracestate is None else {"traceparent": traceparent,
                                                                       "tracestate": tracestate}
    return _W3C.extract(carrier)  # type: ignore[union-attr]


def set_error(span: Any, description: str) -> None:
    """End ``span`` as failed (a job stopped, refused, or failed)."""
    span.set_status(Status(StatusCode.ERROR, description))


def link(trace_context: TraceContext, attributes: Mapping[str, Any]) -> Any:
    """A link to a job's producer span (a batch's span links each item's)."""
    return trace.Link(trace.get_current_span(parent(trace_context)).get_span_context(), dict(attributes))


@contextlib.contextmanager
def enqueue_span(kinds: list[str], n: int) -> Iterator[tuple[Any, TraceContext | None]]:
    """Around an enqueue called with a span active: a producer span ``enqueue {kind}``, current
    inside, and the trace to store with the jobs (that span's; the caller's when no provider records)."""
    kind = kinds[0] if len(set(kinds)) == 1 else "jobs"
    attributes = {"messaging.system": SYSTEM, "messaging.operation.type": "send", "gpuq.job.count": n}
    if kind != "jobs":
        attributes["gpuq.job.kind"] = kind
    with tracer().start_as_current_span(f"enqueue {kind}", kind=SpanKind.PRODUCER,
                                        attributes=attributes) as span:
        yield span, current()
