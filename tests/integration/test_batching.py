"""Batching small jobs (issue #31): the policies, the jobs' cost and batch_key columns, and batches end to end."""

import json

import anyio
import asyncpg
import pytest

from gpuq import admin, metrics, plans, queue
from gpuq.harness import TOKEN, http_get, running_server
from gpuq.jobs import NewJob
from gpuq.producer import enqueue, enqueue_many
from gpuq.sql import queries
from tests.helpers import add_pending, seed_history, wait_for


async def test_a_policy_is_set_changed_listed_and_removed(conn):
    await admin.set_batching(conn, "embed", 64, max_wait_ms=10)
    await admin.set_batching(conn, "score", 8, max_cost=4096)
    await admin.set_batching(conn, "embed", 32)  # a change replaces the whole policy
    got = [(p["kind"], p["max_items"], p["max_wait_ms"], p["max_cost"]) for p in await admin.batching(conn)]
    assert got == [("embed", 32, 0, None), ("score", 8, 0, 4096)]
    await admin.set_batching(conn, "embed", None)
    await admin.set_batching(conn, "nothing", None)  # removing what is not there: nothing to do
    assert [p["kind"] for p in await admin.batching(conn)] == ["score"]


@pytest.mark.parametrize(("args", "says"), [
    (("bad kind", 4), "bad job kind"),
    (("embed", 0), "max_items must be 1-4096"),
    (("embed", 4097), "max_items must be 1-4096"),
    (("embed", 4, -1), "max_wait_ms must be 0-3600000"),
    (("embed", 4, 0, 0), "max_cost must be a positive whole number"),
])
async def test_a_bad_policy_is_a_clear_error_before_the_statement(conn, args, says):
    with pytest.raises(ValueError, match=says):
        await admin.set_batching(conn, *args)
    assert await admin.batching(conn) == []


@pytest.mark.parametrize(("values", "constraint"), [
    (("embed", 0, 0, None), "batch_policies_items_check"),
    (("embed", 4, -1, None), "batch_policies_wait_check"),
    (("embed", 4, 0, 0), "batch_policies_cost_check"),
    (("bad kind", 4, 0, None), "batch_policies_kind_check"),
])
async def test_plain_sql_cannot_store_a_bad_policy(conn, values, constraint):
    with pytest.raises(asyncpg.CheckViolationError, match=constraint):
        await conn.execute("INSERT INTO gpuq.batch_policies (kind, max_items, max_wait_ms, max_cost) "
                           "VALUES ($1, $2, $3, $4)", *values)


async def test_a_policy_change_wakes_the_dispatchers(live_conn, dsn):
    heard: list[str] = []
    listener = await asyncpg.connect(dsn)
    try:
        await listener.add_listener("gpuq_jobs", lambda *args: heard.append(args[-1]))
        await admin.set_batching(live_conn, "embed", 16)
        await wait_for(lambda: heard == ["*"])  # every kind: each dispatcher reads the policies again
    finally:
        await listener.close()


async def test_a_job_keeps_its_cost_and_batch_key_and_sql_checks_them(conn):
    keyed = await enqueue(conn, "embed", {"t": "hi"}, cost=512, batch_key="len-128")
    plain = await enqueue(conn, "embed")
    rows = await conn.fetch("SELECT id, cost, batch_key FROM gpuq.jobs WHERE id = ANY($1) ORDER BY id", [keyed, plain])
    assert [(r["cost"], r["batch_key"]) for r in rows] == [(512, "len-128"), (None, None)]
    for cost, batch_key, constraint in ((-1, None, "jobs_cost_check"), (None, "", "jobs_batch_key_check")):
        with pytest.raises(asyncpg.CheckViolationError, match=constraint):
            async with conn.transaction():  # a savepoint: the test's transaction goes on
                await conn.execute("INSERT INTO gpuq.jobs (kind, cost, batch_key) VALUES ('embed', $1, $2)",
                                   cost, batch_key)


def batch_recorder(calls: list, fail_ids: tuple[int, ...] = ()):
    """A batch handler that records each call's job ids and answers each job its payload's ``i``
    doubled, or an exception for the ids in ``fail_ids``."""
    async def handle(jobs):
        calls.append([j.id for j in jobs])
        return [ValueError(f"bad item {j.id}") if j.id in fail_ids else j.payload["i"] * 2 for j in jobs]
    return handle


async def _done(conn, ids) -> bool:
    return await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE id = ANY($1) AND status = 'done'", ids) == len(ids)


async def test_queued_jobs_go_in_batches_of_at_most_max_items_with_their_own_results(dsn, live_conn):
    await admin.set_batching(live_conn, "embed", 4)
    ids = [await enqueue(live_conn, "embed", {"i": i}) for i in range(10)]
    calls: list = []
    sizes_before = metrics.REGISTRY.get_sample_value("gpuq_batch_size_count", {"kind": "embed"}) or 0
    sum_before = metrics.REGISTRY.get_sample_value("gpuq_batch_size_sum", {"kind": "embed"}) or 0
    formed_before = metrics.REGISTRY.get_sample_value("gpuq_batch_forming_seconds_count", {"kind": "embed"}) or 0
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["embed"], 1, None, "batcher", batch_handler=batch_recorder(calls), max_batch=64)
        await wait_for(lambda: _done(live_conn, ids))
        status = json.loads((await http_get(f"{srv.http}/status", token=TOKEN))[2])
    assert status["batching"] == [{"kind": "embed", "max_items": 4, "max_wait_ms": 0, "max_cost": None}]
    assert [a["batch"] for a in status["agents"]] == [64]
    assert sorted(i for call in calls for i in call) == ids  # each job once
    assert [len(c) for c in calls] == [4, 4, 2]  # one credit: one batch at a time, in lease order
    assert calls == [ids[0:4], ids[4:8], ids[8:10]]
    rows = await live_conn.fetch("SELECT id, result, attempts FROM gpuq.jobs WHERE id = ANY($1) ORDER BY id", ids)
    assert [r["result"] for r in rows] == [i * 2 for i in range(10)]
    assert {r["attempts"] for r in rows} == {1}
    shown = [await admin.show(live_conn, i) for i in (ids[5], ids[9])]  # the batch each ran in: its lead, its size
    assert [(s["batch_id"], s["batch_size"]) for s in shown] == [(ids[4], 4), (ids[8], 2)]
    sizes = metrics.REGISTRY.get_sample_value
    assert sizes("gpuq_batch_size_count", {"kind": "embed"}) - sizes_before == 3
    assert sizes("gpuq_batch_size_sum", {"kind": "embed"}) - sum_before == 10
    assert metrics.REGISTRY.get_sample_value("gpuq_batch_forming_seconds_count", {"kind": "embed"}) - formed_before == 10


async def test_an_item_s_error_fails_that_job_alone(dsn, live_conn):
    await admin.set_batching(live_conn, "embed", 8)
    ids = [await enqueue(live_conn, "embed", {"i": i}, max_attempts=1) for i in range(5)]
    calls: list = []
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["embed"], 1, None, "batcher", batch_handler=batch_recorder(calls, fail_ids=(ids[2],)))

        async def ended() -> bool:
            return await live_conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE id = ANY($1) "
                                            "AND status IN ('done', 'dead')", ids) == 5

        await wait_for(ended)
    rows = {r["id"]: r for r in await live_conn.fetch("SELECT id, status, attempts, last_error FROM gpuq.jobs "
                                                      "WHERE id = ANY($1)", ids)}
    assert calls == [ids]
    assert rows[ids[2]]["status"] == "dead" and f"bad item {ids[2]}" in rows[ids[2]]["last_error"]
    assert [rows[i]["status"] for i in ids if i != ids[2]] == ["done"] * 4
    assert {rows[i]["attempts"] for i in ids} == {1}  # no good item ran twice


async def test_batches_keep_keys_apart_and_stay_within_the_cost_budget(dsn, live_conn):
    await admin.set_batching(live_conn, "embed", 64, max_cost=1000)
    spec = [("short", 400), ("long", 900), ("short", 400), ("short", 400), ("long", 5000), ("long", 50)]
    ids = [await enqueue(live_conn, "embed", {"i": i}, batch_key=key, cost=cost) for i, (key, cost) in enumerate(spec)]
    calls: list = []
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["embed"], 1, None, "batcher", batch_handler=batch_recorder(calls))
        await wait_for(lambda: _done(live_conn, ids))
    by_id = dict(zip(ids, spec, strict=True))
    assert sorted(i for call in calls for i in call) == ids
    for call in calls:
        assert len({by_id[i][0] for i in call}) == 1  # one key a batch
        assert len(call) == 1 or sum(by_id[i][1] for i in call) <= 1000  # within budget, or alone
    assert [ids[4]] in calls  # over the budget alone: it ran alone


async def test_a_partial_batch_waits_max_wait_for_more_and_a_full_one_goes_at_once(dsn, live_conn):
    await admin.set_batching(live_conn, "embed", 3, max_wait_ms=400)
    calls: list = []
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["embed"], 1, None, "batcher", batch_handler=batch_recorder(calls))
        lone = await enqueue(live_conn, "embed", {"i": 0})
        await wait_for(lambda: _done(live_conn, [lone]))
        waited = await live_conn.fetchval("SELECT extract(epoch FROM started_at - run_at) FROM gpuq.jobs WHERE id = $1",
                                          lone)
        assert waited >= 0.4  # no more came: it went alone once it had waited max_wait
        full = await enqueue_many(live_conn, [NewJob("embed", {"i": i}) for i in range(3)])
        await wait_for(lambda: _done(live_conn, full))
    assert calls == [[lone], full]


async def test_an_agent_without_a_batch_handler_gets_the_batched_kind_one_job_at_a_time(dsn, live_conn):
    await admin.set_batching(live_conn, "embed", 4)
    ids = [await enqueue(live_conn, "embed", {"i": i}) for i in range(3)]
    seen: list = []

    async def single(job):
        seen.append(job.id)
        return job.payload["i"]

    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["embed"], 1, single, "plain")
        await wait_for(lambda: _done(live_conn, ids))
    assert seen == ids


async def test_an_agent_gets_batched_kinds_in_batches_and_its_other_kinds_one_by_one(dsn, live_conn):
    await admin.set_batching(live_conn, "embed", 8)
    batched = [await enqueue(live_conn, "embed", {"i": i}) for i in range(3)]
    singles = [await enqueue(live_conn, "other", {"i": i}) for i in range(3)]
    calls: list = []
    seen: list = []

    async def single(job):
        seen.append(job.id)
        return job.payload["i"]

    async with running_server(dsn, poll_seconds=60) as srv:  # no poll: freed credit must bring the rest
        await srv.agent(["embed", "other"], 1, single, "both", batch_handler=batch_recorder(calls))
        await wait_for(lambda: _done(live_conn, batched + singles))
    assert calls == [batched] and seen == singles


async def test_placed_jobs_batch_per_shape_and_each_batch_takes_one_device(dsn, live_conn):
    from gpuq.protocol import Device

    await admin.set_batching(live_conn, "embed", 3)
    gpu = [await enqueue(live_conn, "embed", {"i": i}, gpus=1, model="bge") for i in range(6)]
    keyed = [await enqueue(live_conn, "embed", {"i": i}, concurrency_key="tenant-a") for i in range(2)]
    calls: list = []
    both_running = anyio.Event()

    async def handle(jobs):
        calls.append(([j.id for j in jobs], {tuple(j.devices) for j in jobs}))
        if sum(1 for ids, devices in calls if devices != {()}) == 2:
            both_running.set()
        if jobs[0].devices:
            await both_running.wait()  # two batches at once: one on each device
        return [j.payload["i"] for j in jobs]

    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["embed"], 1, None, "gpu-box", batch_handler=handle, max_batch=64,
                        devices=[Device(0, "h100", 81920), Device(1, "h100", 81920)], models=["bge"])
        await wait_for(lambda: _done(live_conn, gpu + keyed))
    gpu_calls = [(ids, devices) for ids, devices in calls if devices != {()}]
    assert sorted(ids for ids, _ in gpu_calls) == [gpu[0:3], gpu[3:6]]  # one shape, in lease order
    assert sorted(devices for _, devices in gpu_calls) == [{(0,)}, {(1,)}]  # a batch shares its one device
    assert [ids for ids, devices in calls if devices == {()}] == [keyed]  # keyed jobs (a shape too) batch
    rows = await live_conn.fetch("SELECT batch_id, batch_size FROM gpuq.jobs WHERE id = ANY($1) ORDER BY id", gpu)
    assert [(r["batch_id"], r["batch_size"]) for r in rows] == [(gpu[0], 3)] * 3 + [(gpu[3], 3)] * 3


async def test_a_limited_key_s_batched_jobs_go_one_by_one(dsn, live_conn):
    await admin.set_batching(live_conn, "embed", 8)
    await admin.set_limit(live_conn, "key", "tenant-a", 1)
    ids = [await enqueue(live_conn, "embed", {"i": i}, concurrency_key="tenant-a") for i in range(3)]
    calls: list = []
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["embed"], 4, None, "batcher", batch_handler=batch_recorder(calls))
        await wait_for(lambda: _done(live_conn, ids))
    assert calls == [[i] for i in ids]  # a limit counts jobs: each alone, within it


async def _batch_buffers(conn) -> dict[str, int]:
    """Buffers read by a 128-job head of plain and of 1-GPU jobs, and by leasing 64 of them in one batch."""
    await conn.execute("ANALYZE gpuq.jobs")
    [gpu] = [s for s in await queue.read_shapes(conn) if s.gpus == 1]
    ids = [h.id for h in await queue.batch_head(conn, "train", 64)]
    statements = {"head": (queries["batch_head"], "train", 128),
                  "head_placed": (queries["batch_head_placed"], "train", gpu.digest, 128),
                  "lease": (queries["lease_batched"], "train", ids, ["x"] * 64, 30.0, [ids[0]] * 64, [64] * 64, None)}
    return await plans.statements_buffers(conn, statements)


async def test_forming_and_leasing_batches_ignore_done_history(conn):
    """The buffers guard for batches: 100k done rows ahead of the pending ones cost a head read and a
    batch lease nothing (they read the partial indexes and primary key lookups, never history)."""
    async def pending() -> None:
        await add_pending(conn, 300)
        await conn.execute("INSERT INTO gpuq.jobs (kind, gpus) SELECT 'train', 1 FROM generate_series(1, 300)")

    await pending()
    without = await _batch_buffers(conn)
    await conn.execute("TRUNCATE gpuq.jobs RESTART IDENTITY")
    await seed_history(conn, 100_000)
    await pending()
    with_history = await _batch_buffers(conn)
    for name in without:
        assert with_history[name] <= without[name] * 1.5 + 8, (name, without, with_history)


async def test_a_job_waiting_in_a_partial_batch_goes_one_by_one_once_the_policy_is_removed(dsn, live_conn):
    """The policy read that ends batching comes in a pass of its own (reads are throttled): the
    kind's group for an agent that takes batches changes then, and must be looked at then, not at
    the next poll (it once was: up to a poll interval late)."""
    from gpuq.dispatcher.tuning import Tuning

    await admin.set_batching(live_conn, "embed", 8, max_wait_ms=600_000)  # a partial batch waits
    calls: list = []
    async with running_server(dsn, poll_seconds=60, tuning=Tuning(shapes_seconds=1)) as srv:
        await srv.agent(["embed"], 1, None, "batcher", batch_handler=batch_recorder(calls))
        job = await enqueue(live_conn, "embed", {"i": 1})
        await admin.set_batching(live_conn, "embed", None)  # within the throttle: read a little later
        await wait_for(lambda: _done(live_conn, [job]), timeout=15)
    assert calls == [[job]]
