"""OpenTelemetry traces (gpuq[otel]): what gpuq.enqueue stores of its producer span; without a
tracer provider, nothing stored."""

import asyncpg
import pytest

import gpuq
from gpuq import NewJob, tracing
from gpuq.sql import queries


def traceparent_of(span) -> str:
    return f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-{span.context.trace_flags:02x}"


async def test_without_a_tracer_provider_nothing_is_stored_and_the_enqueue_is_one_statement(pool):
    assert not tracing.recording()
    statements: list = []
    async with pool.acquire() as conn:
        conn.add_query_logger(statements.append)
        with tracing.trace.get_tracer("test").start_as_current_span("request"):  # the API's no-op span
            job_id = await gpuq.enqueue(conn, "embed")
        conn.remove_query_logger(statements.append)
    [insert] = [s for s in statements if "gpuq." in s.query]  # not asyncpg's own type introspection
    assert insert.query == queries["enqueue_plain"] and insert.args[-2:] == (None, None)
    assert await pool.fetchval("SELECT traceparent FROM gpuq.jobs WHERE id = $1", job_id) is None


async def test_the_table_refuses_a_malformed_traceparent(conn):
    for bad in ("not-a-traceparent", '00-"' + "0" * 30 + '"-b7ad6b7169203331-01'):
        with pytest.raises(asyncpg.CheckViolationError, match="jobs_traceparent_check"):
            async with conn.transaction():  # a savepoint
                await conn.execute("INSERT INTO gpuq.jobs (kind, traceparent) VALUES ('embed', $1)", bad)


async def test_show_has_the_trace_a_job_was_enqueued_with(pool, spans):
    with tracing.trace.get_tracer("test").start_as_current_span("request") as request:
        job_id = await gpuq.enqueue(pool, "embed")
    shown = await gpuq.show(pool, job_id)
    assert shown["traceparent"].startswith(f"00-{request.get_span_context().trace_id:032x}-")
    assert shown["tracestate"] is None


async def test_enqueue_many_stores_its_one_producer_spans_trace_with_every_job(pool, spans):
    with tracing.trace.get_tracer("test").start_as_current_span("request"):
        ids = await gpuq.enqueue_many(pool, [NewJob("embed"), NewJob("render", dedup_key="k")])  # two statements
    [enqueue] = [s for s in spans.get_finished_spans() if s.name.startswith("enqueue")]
    assert enqueue.name == "enqueue jobs" and enqueue.attributes["gpuq.job.count"] == 2
    rows = await pool.fetch("SELECT traceparent FROM gpuq.jobs WHERE id = ANY($1)", ids)
    assert [r["traceparent"] for r in rows] == [traceparent_of(enqueue)] * 2
