"""Traces without a server (gpuq[otel]): the push's trace fields by protocol version, the agent's
handler spans (a batch's links, a stopped handler), the server's spans held from lease to outcome."""

import asyncio
import importlib
import json
import sys

import pytest
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

from gpuq import tracing
from gpuq.agent import spans as agent_spans
from gpuq.dispatcher import spans as server_spans
from gpuq.jobs import FailOutcome, LeasedJob
from gpuq.protocol import Done, Failed, Hello, JobMessage, ProtocolError, Welcome, parse_server
from gpuq.protocol.agent_side import AgentProtocol
from gpuq.protocol.frames import job_message
from gpuq.protocol.server_side import ServerProtocol

TOKEN = "00000000-0000-0000-0000-000000000001"
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
OTHER = "00-1bf7651916cd43dd8448eb211c80319c-c7ad6b7169203331-01"
STATE = 'congo=t61rcWkgMzE,rojo="00f067aa0ba902b7"'  # a quote: tracestate is encoded, not spliced


def leased(job_id: int, traceparent: str | None = PARENT, tracestate: str | None = STATE,
           queued_ms: int = 60_000) -> LeasedJob:
    return LeasedJob(job_id, "embed", 1, 5, TOKEN, 0, "a#1", "{}", queued_ms=queued_ms,
                     trace=None if traceparent is None else (traceparent, tracestate))


def pushed_to(version: int, jobs: list[LeasedJob]) -> list[dict]:
    p = ServerProtocol(max_payload=1 << 16, max_messages_per_second=1000, now=0.0)
    p.receive(json.dumps({"type": "hello", "agent": "a", "kinds": ["embed"], "capacity": 4, "protocol": version,
                          "devices": [], "labels": [], "models": [], "prefetch": 0, "batch": 0}), 0.0)
    p.accept(Welcome("a#1", 30, 5, 1 << 16))
    p.frames_to_send()
    p.send_jobs(jobs)
    [frame] = p.frames_to_send()
    return json.loads(frame)["jobs"]


# -- the wire (protocol 8) ------------------------------------------------------


def test_a_version_8_agent_gets_the_trace_of_a_traced_job_and_parses_it_back():
    untraced, traced, no_state = pushed_to(8, [leased(1, None, None), leased(2), leased(3, tracestate=None)])
    assert "traceparent" not in untraced and "tracestate" not in untraced
    assert (traced["traceparent"], traced["tracestate"]) == (PARENT, STATE)
    assert no_state["traceparent"] == PARENT and "tracestate" not in no_state
    frame = '{"type":"jobs","jobs":[' + job_message(2, TOKEN, "embed", "{}", 1, trace=(PARENT, STATE)) + "]}"
    [job] = parse_server(frame).jobs
    assert job.trace == (PARENT, STATE)


def test_an_agent_before_version_8_gets_no_trace_fields():
    [job] = pushed_to(7, [leased(1)])
    assert "traceparent" not in job and "tracestate" not in job


@pytest.mark.parametrize("fields", ['"traceparent":7', '"traceparent":null', '"traceparent":""',
                                    f'"traceparent":"{PARENT}","tracestate":"{"x" * 513}"'])
def test_a_malformed_trace_from_the_server_is_refused(fields):
    frame = job_message(1, TOKEN, "embed", "{}", 1)[:-1] + "," + fields + "}"
    with pytest.raises(ProtocolError, match="trace"):
        parse_server('{"type":"jobs","jobs":[' + frame + "]}")


# -- the agent's handler span -------------------------------------------------------


def agent_protocol() -> AgentProtocol:
    p = AgentProtocol(Hello("gpu-box", ("embed",), 2))
    p.connection_made()
    p.receive(json.dumps({"type": "welcome", "agent_id": "gpu-box#1", "protocol": 8, "lease_seconds": 30,
                          "heartbeat_seconds": 5, "max_payload": 1 << 20}))
    return p


def job(job_id: int, traceparent: str | None = PARENT, batch: int | None = None, devices=()) -> JobMessage:
    return JobMessage(job_id, TOKEN, "embed", {}, 2, devices=devices, batch=batch,
                      trace=None if traceparent is None else (traceparent, None))


def test_a_handler_runs_in_a_span_continuing_the_jobs_trace(spans):
    seen = []
    handler = agent_spans.traced(lambda: lambda j: seen.append(trace.get_current_span()), agent_protocol(),
                                 is_async=False)
    handler(job(7, devices=(0, 3)))
    [span] = spans.get_finished_spans()
    assert seen[0].get_span_context().span_id == span.context.span_id  # current inside the handler
    assert span.name == "run embed" and span.kind is SpanKind.CONSUMER
    assert span.context.trace_id == int(PARENT[3:35], 16) and span.parent.span_id == int(PARENT[36:52], 16)
    assert dict(span.attributes) == {"messaging.system": "gpuq", "messaging.operation.type": "process",
                                     "gpuq.job.kind": "embed", "gpuq.agent": "gpu-box#1", "gpuq.job.id": 7,
                                     "gpuq.job.attempt": 2, "gpuq.devices": (0, 3)}


def test_a_batch_runs_in_one_span_linked_to_each_traced_item(spans):
    calls = []

    async def embed_many(jobs):
        calls.append([j.id for j in jobs])
        return [None] * len(jobs)

    handler = agent_spans.traced_batch(lambda: embed_many, agent_protocol(), is_async=True)
    asyncio.run(handler([job(1, OTHER, batch=1), job(2, None, batch=1), job(3, batch=1)]))
    [span] = spans.get_finished_spans()
    assert calls == [[1, 2, 3]]
    assert span.context.trace_id == int(OTHER[3:35], 16)  # the first traced item's trace
    assert [(link.context.trace_id, link.attributes["gpuq.job.id"]) for link in span.links] == [
        (int(OTHER[3:35], 16), 1), (int(PARENT[3:35], 16), 3)]
    assert span.attributes["gpuq.batch.size"] == 3 and span.attributes["gpuq.job.ids"] == (1, 2, 3)


def test_a_batch_with_no_traced_item_makes_no_span(spans):
    handler = agent_spans.traced_batch(lambda: lambda jobs: [1] * len(jobs), agent_protocol(), is_async=False)
    assert handler([job(1, None, batch=1), job(2, None, batch=1)]) == [1, 1]
    assert spans.get_finished_spans() == ()


def test_a_failed_or_stopped_handler_ends_its_span_with_an_error(spans):
    async def fails(j):
        raise ValueError("bad input")

    async def stopped(j):
        raise asyncio.CancelledError

    for handler, error in ((fails, ValueError), (stopped, asyncio.CancelledError)):
        with pytest.raises(error):
            asyncio.run(agent_spans.traced(lambda h=handler: h, agent_protocol(), is_async=True)(job(1)))
    failed, cancelled = spans.get_finished_spans()
    assert failed.status.status_code is StatusCode.ERROR and "bad input" in failed.status.description
    assert cancelled.status.status_code is StatusCode.ERROR and cancelled.status.description == agent_spans.STOPPED


def test_without_a_tracer_provider_the_handler_runs_alone():
    assert not tracing.recording()
    handler = agent_spans.traced(lambda: lambda j: trace.get_current_span(), agent_protocol(), is_async=False)
    assert not handler(job(1)).get_span_context().is_valid


# -- the server's spans ------------------------------------------------------------


def test_the_server_spans_a_traced_jobs_lease_and_outcome_and_nothing_else(spans):
    s = server_spans.ServerSpans()
    started = s.lease_started()
    s.leased([leased(1), leased(2, None, None), leased(3), leased(4)], started)
    assert s.write_started()
    outcomes = {3: FailOutcome(3, "scheduled", None), 4: FailOutcome(4, "dead", None)}
    s.finished(s.write_started(), [Done(1, TOKEN, None), Done(2, TOKEN, None)],
               [Failed(3, TOKEN, "Traceback\nOSError: disk", True), Failed(4, TOKEN, "no", False)], {1, 2}, outcomes)
    got = {(x.name, x.attributes["gpuq.job.id"]): x for x in spans.get_finished_spans()}
    assert sorted(got) == [("complete embed", 1), ("complete embed", 3), ("complete embed", 4),
                           ("lease embed", 1), ("lease embed", 3), ("lease embed", 4)]
    assert [got["complete embed", i].attributes["gpuq.job.outcome"] for i in (1, 3, 4)] == ["done", "retry", "dead"]
    assert got["complete embed", 3].status.description == "OSError: disk"
    lease = got["lease embed", 1]
    assert lease.parent.span_id == int(PARENT[36:52], 16) and lease.start_time == started  # due long before
    assert dict(lease.attributes)["gpuq.agent"] == "a#1" and lease.attributes["gpuq.job.attempt"] == 1
    assert not s.write_started()  # every traced job reported: nothing held


def test_a_lease_span_starts_no_earlier_than_its_job_became_due(spans):
    s = server_spans.ServerSpans()
    started = s.lease_started() - 10**9  # the pass began a second ago
    s.leased([leased(1, queued_ms=0), leased(2, queued_ms=500)], started)  # enqueued while it ran
    first, second = spans.get_finished_spans()
    assert first.start_time == first.end_time and second.start_time == second.end_time - 500_000_000 > started


def test_an_outcome_of_another_lease_or_a_forgotten_job_gets_no_span(spans):
    s = server_spans.ServerSpans()
    s.leased([leased(1), leased(2)], s.lease_started())
    s.forget([2])
    s.finished(s.write_started(), [Done(1, "00000000-0000-0000-0000-000000000009", None), Done(2, TOKEN, None)],
               [], {1, 2}, {})
    assert [x.name for x in spans.get_finished_spans()] == ["lease embed", "lease embed"]
    assert s.write_started()  # job 1 is held still, for its own lease's outcome


def test_without_a_tracer_provider_the_server_makes_no_span_and_holds_nothing():
    s = server_spans.ServerSpans()
    s.leased([leased(1)], s.lease_started())
    assert s.write_started() == 0


def test_without_opentelemetry_installed_nothing_is_asked_or_made(monkeypatch):
    monkeypatch.setitem(sys.modules, "opentelemetry", None)  # its import fails, as when not installed
    importlib.reload(tracing)
    try:
        assert not tracing.AVAILABLE and not tracing.recording() and not tracing.active()
        assert tracing.current() is None
        assert agent_spans.traced(lambda: print, agent_protocol(), is_async=False) is None  # the slots call it
        assert agent_spans.traced_batch(lambda: print, agent_protocol(), is_async=True) is None
        s = server_spans.ServerSpans()
        assert s.lease_started() == 0
        s.leased([leased(1)], s.lease_started())
        assert s.write_started() == 0
    finally:
        monkeypatch.undo()
        importlib.reload(tracing)
    assert tracing.AVAILABLE
