"""OpenTelemetry traces (gpuq[otel]) across a real server and real agents: one trace from the
producer's enqueue to the outcome's commit; without a tracer provider, nothing stored or sent."""

import asyncpg
import pytest

import gpuq
from gpuq import NewJob, tracing
from gpuq.harness import next_of, raw_agent, running_server
from gpuq.protocol import Device
from gpuq.sql import queries
from tests.helpers import wait_for


def traceparent_of(span) -> str:
    return f"00-{span.context.trace_id:032x}-{span.context.span_id:016x}-{span.context.trace_flags:02x}"


async def test_one_trace_runs_from_enqueue_through_lease_and_handler_to_completion(dsn, pool, spans):
    tracer = tracing.trace.get_tracer("test")

    async def embed(job):  # async: a slot's asyncio task
        with tracer.start_as_current_span("inside embed"):
            return {"ok": job.id}

    def render(job):  # sync, with a device: a worker thread, a placed lease
        with tracer.start_as_current_span("inside render"):
            return {"devices": list(job.devices)}

    async with running_server(dsn) as srv:
        await srv.agent(["embed"], 2, embed, name="cpu")
        await srv.agent(["render"], 1, render, name="gpu", devices=(Device(0, "sim", 1024),))
        with tracer.start_as_current_span("request") as request:
            ids = {"embed": await gpuq.enqueue(pool, "embed", {"n": 1}),
                   "render": await gpuq.enqueue(pool, "render", gpus=1)}
        for job_id in ids.values():
            assert await gpuq.wait(pool, job_id, timeout=10) is not None
        await wait_for(lambda: sum(s.name.startswith("complete") for s in spans.get_finished_spans()) == 2)
    got = {s.name: s for s in spans.get_finished_spans()}
    trace_id = request.get_span_context().trace_id
    assert {s.context.trace_id for s in got.values()} == {trace_id}
    for kind, job_id in ids.items():
        row = await pool.fetchrow("SELECT traceparent, tracestate, leased_by FROM gpuq.jobs WHERE id = $1", job_id)
        enqueue, lease, run, complete = (got[f"{op} {kind}"] for op in ("enqueue", "lease", "run", "complete"))
        assert enqueue.parent.span_id == request.get_span_context().span_id
        assert (row["traceparent"], row["tracestate"]) == (traceparent_of(enqueue), None)
        assert {s.parent.span_id for s in (lease, run, complete)} == {enqueue.context.span_id}
        assert got[f"inside {kind}"].parent.span_id == run.context.span_id
        for s in (lease, run, complete):
            assert (s.attributes["gpuq.job.id"], s.attributes["gpuq.job.kind"], s.attributes["gpuq.agent"],
                    s.attributes["gpuq.job.attempt"]) == (job_id, kind, row["leased_by"], 1)
        assert lease.end_time <= run.start_time and run.end_time <= complete.end_time  # push, handler, commit
        assert complete.attributes["gpuq.job.outcome"] == "done"
    assert got["run render"].attributes["gpuq.devices"] == (0,) and "gpuq.devices" not in got["run embed"].attributes


async def test_without_a_tracer_provider_nothing_is_stored_and_the_enqueue_is_one_statement(dsn, pool):
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
    async with running_server(dsn) as srv:
        ws, _ = await raw_agent(srv, protocol=8, devices=[], labels=[], models=[], prefetch=0, batch=0)
        [pushed] = (await next_of(ws, "jobs"))["jobs"]
        await ws.close()
    assert pushed["id"] == job_id and "traceparent" not in pushed


async def test_a_traced_job_carries_its_trace_to_a_version_8_agent_only_whatever_the_server_records(dsn, pool):
    parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    first, second = [await pool.fetchval("INSERT INTO gpuq.jobs (kind, traceparent, tracestate) "
                                         "VALUES ('embed', $1, 'k=v') RETURNING id", parent) for _ in range(2)]
    async with running_server(dsn) as srv:
        new, _ = await raw_agent(srv, name="new", protocol=8, devices=[], labels=[], models=[], prefetch=0, batch=0)
        [to_new] = (await next_of(new, "jobs"))["jobs"]
        old, _ = await raw_agent(srv, name="old", protocol=7, devices=[], labels=[], models=[], prefetch=0, batch=0)
        [to_old] = (await next_of(old, "jobs"))["jobs"]
        for ws in (new, old):
            await ws.close()
    assert (to_new["id"], to_new["traceparent"], to_new["tracestate"]) == (first, parent, "k=v")
    assert to_old["id"] == second and "traceparent" not in to_old and "tracestate" not in to_old


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
