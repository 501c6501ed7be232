"""Fair share, the lease order (issue #32): each free slot to the tenant with work whose usage per
weight is least; a tenant back from idle starts at the least; the reads touch no history.

Most tests drive ``FairShare`` on one connection (the ``conn`` fixture's transaction), leasing
to made-up slots with no agent: what is leased, in which order, is the statement's and the
ledger's business alone.
"""

from collections import Counter

import anyio

from gpuq import admin, plans, queue
from gpuq.dispatcher import Tuning
from gpuq.dispatcher.fairshare import FairShare
from gpuq.dispatcher.trigger import Pass
from gpuq.harness import running_server
from gpuq.jobs import NewJob
from gpuq.protocol import Device
from gpuq.sql import queries
from tests.helpers import dispatcher_idle, wait_for

SLOTS = ["a#1"] * 4


async def _fair(conn, **weights: float) -> FairShare:
    for name, weight in weights.items():
        await admin.set_tenant(conn, name, weight)
    fair = FairShare(conn, Tuning(fair_share_seconds=0))
    await fair.refresh(Pass(every=True))
    assert fair.on
    return fair


async def _enqueue(conn, tenant: str | None, n: int, kind: str = "train", priority: int = 0) -> list[int]:
    return await queue.enqueue_many(conn, [NewJob(kind, {"i": i}, tenant=tenant, priority=priority)
                                           for i in range(n)])


async def _tenants_of(conn, jobs) -> list[str]:
    rows = await conn.fetch("SELECT id, coalesce(tenant, 'default') AS t FROM gpuq.jobs WHERE id = ANY($1)",
                            [j.id for j in jobs])
    by_id = {r["id"]: r["t"] for r in rows}
    return [by_id[j.id] for j in jobs]


async def test_slots_go_to_tenants_by_weight_and_priority_orders_within_a_tenant(conn):
    a = await _enqueue(conn, "a", 40)
    urgent = await _enqueue(conn, "a", 1, priority=5)
    await _enqueue(conn, "b", 40)
    fair = await _fair(conn, a=3, b=1)
    leased = []
    for _ in range(4):
        jobs, more = await fair.lease(["train"], SLOTS, 30)
        assert more and len(jobs) == 4
        leased += jobs
    tenants = await _tenants_of(conn, leased)
    assert Counter(tenants) == {"a": 12, "b": 4}, tenants  # 3 : 1, one expected job each a slot
    a_ids = [j.id for j, t in zip(leased, tenants, strict=True) if t == "a"]
    assert a_ids == urgent + a[:11]  # within a tenant: priority, then id


async def test_the_default_tenant_is_a_tenant_and_a_row_may_name_it(conn):
    await _enqueue(conn, None, 3)
    await conn.execute("INSERT INTO gpuq.jobs (kind, tenant) VALUES ('train', 'default')")
    await _enqueue(conn, "b", 10)
    fair = await _fair(conn, b=1)
    jobs, _more = await fair.lease(["train"], ["a#1"] * 8, 30)
    assert Counter(await _tenants_of(conn, jobs)) == {"default": 4, "b": 4}


async def test_a_tenant_whose_work_ran_out_leaves_its_slots_to_the_others(conn):
    await _enqueue(conn, "a", 2)
    await _enqueue(conn, "b", 20)
    fair = await _fair(conn, a=100, b=1)
    jobs, more = await fair.lease(["train"], ["a#1"] * 6, 30)
    assert Counter(await _tenants_of(conn, jobs)) == {"a": 2, "b": 1}  # a's tickets left unfilled
    assert more  # b has more: the group leases again
    jobs, more = await fair.lease(["train"], ["a#1"] * 3, 30)
    assert await _tenants_of(conn, jobs) == ["b"] * 3 and more
    jobs, more = await fair.lease(["train"], ["a#1"] * 30, 30)
    assert len(jobs) == 16 and not more


async def test_a_trickling_tenant_gets_the_next_slot_without_a_refresh(conn):
    """a floods and has used much; b trickles. b's job enqueued after the last read is leased by
    the next lease (a probe of the tenants without known work), ahead of a's flood."""
    await conn.execute("INSERT INTO gpuq.tenant_usage (tenant, usage, attempts) VALUES ('a', 100, 100)")
    await _enqueue(conn, "a", 50)
    await _enqueue(conn, "b", 1)
    fair = await _fair(conn, a=3, b=1)
    jobs, _ = await fair.lease(["train"], ["a#1"], 30)
    assert await _tenants_of(conn, jobs) == ["b"]
    jobs, more = await fair.lease(["train"], ["a#1"], 30)  # b's ticket comes first, unfilled: it ran out
    assert jobs == [] and more and "b" not in fair.ledger.waiting["train"]
    jobs, _ = await fair.lease(["train"], ["a#1"], 30)
    assert await _tenants_of(conn, jobs) == ["a"]
    await _enqueue(conn, "b", 1)  # no read of the ledger from here on
    jobs, _ = await fair.lease(["train"], ["a#1"], 30)
    assert await _tenants_of(conn, jobs) == ["b"]


async def test_a_tenant_back_from_idle_starts_at_the_least_usage_and_cannot_bank_credit(conn):
    """c has used nothing for long; a and b are busy with large usage. Back, c shares slots with
    them by weight from then on instead of taking every slot until its usage caught up."""
    await conn.execute("INSERT INTO gpuq.tenant_usage (tenant, usage, attempts) "
                       "VALUES ('a', 1000, 1000), ('b', 1000, 1000), ('c', 0, 0)")
    await _enqueue(conn, "a", 30)
    await _enqueue(conn, "b", 30)
    fair = await _fair(conn, a=1, b=1, c=1)
    await _enqueue(conn, "c", 30)  # after the read: c is idle as the ledger knows it
    jobs, _ = await fair.lease(["train"], ["a#1"] * 9, 30)
    assert Counter(await _tenants_of(conn, jobs)) == {"a": 3, "b": 3, "c": 3}
    floor = await conn.fetchval("SELECT usage_floor FROM gpuq.tenant_usage WHERE tenant = 'c'")
    assert floor >= 1000  # kept for every server: the next read lifts it again
    fair.ledger.tenants.clear()
    await fair.refresh(Pass())
    jobs, _ = await fair.lease(["train"], ["a#1"] * 9, 30)
    assert Counter(await _tenants_of(conn, jobs)) == {"a": 3, "b": 3, "c": 3}


async def test_usage_per_weight_decides_between_busy_tenants(conn):
    """b used twice a's GPU-seconds per weight: a takes slots until it caught up."""
    await conn.execute("INSERT INTO gpuq.tenant_usage (tenant, usage, attempts) VALUES ('a', 10, 10), ('b', 20, 20)")
    await _enqueue(conn, "a", 30)
    await _enqueue(conn, "b", 30)
    fair = await _fair(conn, a=1, b=1)
    jobs, _ = await fair.lease(["train"], ["a#1"] * 10, 30)
    assert await _tenants_of(conn, jobs) == ["a"] * 10
    jobs, _ = await fair.lease(["train"], ["a#1"] * 4, 30)
    assert Counter(await _tenants_of(conn, jobs)) == {"a": 2, "b": 2}


async def test_paused_and_limited_kinds_are_not_leased_in_the_fair_order_either(conn):
    await _enqueue(conn, "a", 3, kind="paused")
    await _enqueue(conn, "a", 3, kind="limited")
    await _enqueue(conn, "a", 3, kind="open")
    await admin.pause(conn, "paused", "test")
    await admin.set_limit(conn, "kind", "limited", 5)
    fair = await _fair(conn, a=1)
    jobs, _ = await fair.lease(["limited", "open", "paused"], ["a#1"] * 9, 30)
    assert {j.kind for j in jobs} == {"open"} and len(jobs) == 3


async def test_the_fair_reads_and_lease_read_no_history(conn):
    """100,000 done rows and a leased flood: the lease descends once per tenant and kind it leases
    from, the loose scan once per (kind, tenant) with work, the state reads the running jobs."""
    await conn.execute("INSERT INTO gpuq.jobs (kind, status, attempts, finished_at, tenant) "
                       "SELECT 'train', 'done', 1, now(), 't' || (g % 50) FROM generate_series(1, 100000) g")
    await conn.execute("INSERT INTO gpuq.jobs (kind, status, attempts, leased_by, lease_token, lease_expires_at, "
                       "started_at, tenant) SELECT 'train', 'leased', 1, 'a#1', gen_random_uuid(), "
                       "now() + interval '1 min', now(), 't' || (g % 5) FROM generate_series(1, 20) g")
    await queue.enqueue_many(conn, [NewJob("train", tenant=f"t{i % 5}") for i in range(200)] + [NewJob("train")] * 5)
    await queue.enqueue_many(conn, [NewJob("train", tenant=f"t{i % 5}", gpus=1) for i in range(200)])
    (shape,) = await queue.read_shapes(conn)
    await admin.set_tenant(conn, "t0", 2)
    await conn.execute("ANALYZE gpuq.jobs")
    tickets = ["t0", "t1", "default", "t0", "t2", "t3", "t0", "t4"]
    plain = await plans.explain(conn, queries["lease_slots"], *plans.lease_args(["train", "other"], ["a#1"] * 8, 30))
    for name, args, most in (("lease_fair", (["train", "other"], tickets, ["a#1"] * 8, 30),
                              2 * plans.plan_buffers(plain)),  # the same 8 rows written: 95 against 70, measured
                             ("lease_placed_fair", (shape.kind, shape.digest, tickets, ["a#1"] * 8, 30),
                              2 * plans.plan_buffers(plain)),
                             ("fair_waiting", (), 80), ("fair_state", (), 60)):
        plan = await plans.explain(conn, queries[name], *args)
        indexes = plans.plan_indexes(plan)
        assert not [i for i in indexes if i.startswith("seqscan:jobs")], (name, indexes)
        assert "jobs_pending_idx" not in indexes, (name, indexes)  # it would walk other tenants' jobs
        assert plans.plan_buffers(plan) < most, (name, plans.plan_buffers(plan), indexes)


async def test_a_server_s_agents_run_each_tenant_s_jobs_by_weight(dsn, pool):
    """End to end: a weight set, two tenants' backlogs, one agent of 4 slots. The first 40 jobs to
    run are a's and b's at 3 : 1 (one expected job a slot each), not first come first served."""
    ran: list[str] = []

    async def record(job) -> None:
        ran.append(job.payload["t"])
        await anyio.sleep(0.01)

    await admin.set_tenant(pool, "a", 3)
    await queue.enqueue_many(pool, [NewJob("train", {"t": "b"}, tenant="b") for _ in range(60)])
    await queue.enqueue_many(pool, [NewJob("train", {"t": "a"}, tenant="a") for _ in range(60)])
    async with running_server(dsn) as srv:
        await srv.agent(["train"], 4, record)
        await wait_for(lambda: len(ran) >= 40)
    first = Counter(ran[:40])
    assert 28 <= first["a"] <= 32 and first["a"] + first["b"] == 40, first


# -- placed jobs -----------------------------------------------------------------


async def test_placed_jobs_of_a_shape_go_to_tenants_by_weight(conn):
    await queue.enqueue_many(conn, [NewJob("train", tenant="a", gpus=1) for _ in range(20)])
    await queue.enqueue_many(conn, [NewJob("train", tenant="b", gpus=1) for _ in range(20)])
    (shape,) = await queue.read_shapes(conn)
    fair = await _fair(conn, a=1, b=3)
    jobs, more = await fair.lease_placed(shape, ["a#1"] * 8, 30)
    assert more and all(j.gpus == 1 for j in jobs)
    assert Counter(await _tenants_of(conn, jobs)) == {"a": 2, "b": 6}
    assert fair.least(shape) == min(fair.ledger.tenants[t].vt for t in "ab")


async def test_one_tenant_s_unplaceable_jobs_do_not_hold_back_another_s(dsn, pool):
    """a's jobs want 8 GPUs, which no agent has; b's want one: b's run on the 2-GPU agent."""
    devices = [Device(i, "h100", 81920) for i in range(2)]
    ran: list[str] = []

    async def record(job) -> None:
        ran.append(job.payload["t"])

    await admin.set_tenant(pool, "a", 100)
    await queue.enqueue_many(pool, [NewJob("train", {"t": "a"}, tenant="a", gpus=8) for _ in range(5)])
    await queue.enqueue_many(pool, [NewJob("train", {"t": "b"}, tenant="b", gpus=1) for _ in range(5)])
    async with running_server(dsn) as srv:
        await srv.agent(["train"], 2, record, devices=devices)
        await wait_for(lambda: len(ran) >= 5)
    assert ran == ["b"] * 5


async def test_a_tenant_new_to_the_server_is_leased_for_when_its_first_job_is_announced(dsn, pool):
    """Fair share on, the agent idle: a tenant nobody has heard of (no weight, no usage) enqueues.
    Its job's notification has the tenants with work read again: it runs at once, not at the next
    refresh or poll (both a minute away here)."""
    ran: list[str] = []

    async def record(job) -> None:
        ran.append(job.payload["t"])

    await admin.set_tenant(pool, "a", 1)
    async with running_server(dsn, tuning=Tuning(fair_share_seconds=60), poll_seconds=60) as srv:
        await srv.agent(["train"], 2, record)
        await dispatcher_idle()
        await queue.enqueue_many(pool, [NewJob("train", {"t": "newcomer"}, tenant="newcomer")])
        await wait_for(lambda: ran == ["newcomer"], timeout=5)


async def test_two_servers_share_by_weight_from_the_state_in_the_database(dsn, pool):
    """Two servers on one database, an agent each: together their agents run a's and b's jobs at
    3 : 1. Each reads usage and floors from PostgreSQL (every 0.2 s here) and leases with SKIP LOCKED."""
    ran: list[str] = []

    async def record(job) -> None:
        ran.append(job.payload["t"])
        await anyio.sleep(0.02)

    await admin.set_tenant(pool, "a", 3)
    await admin.set_tenant(pool, "b", 1)
    for tenant in "ab":
        await queue.enqueue_many(pool, [NewJob("train", {"t": tenant}, tenant=tenant) for _ in range(150)])
    tuning = Tuning(fair_share_seconds=0.2)
    async with running_server(dsn, tuning=tuning) as one, running_server(dsn, tuning=tuning) as two:
        await one.agent(["train"], 2, record, "one-box")
        await two.agent(["train"], 2, record, "two-box")
        await wait_for(lambda: len(ran) >= 120, timeout=20)
    first = Counter(ran[:120])
    assert 80 <= first["a"] <= 100, first  # 90 : 30 at 3 : 1


async def test_a_flood_is_not_walked_to_lease_another_tenant_s_next_job(conn):
    """a has 20,000 pending jobs of the kind and of the shape, b one of each: b's lease descends
    to b's entries of the fair indexes, never through a's (jobs_pending_idx or jobs_placed_idx
    filtered by tenant would read the flood)."""
    await conn.execute("INSERT INTO gpuq.jobs (kind, tenant) SELECT 'train', 'a' FROM generate_series(1, 20000)")
    await queue.enqueue_many(conn, [NewJob("train", tenant="a", gpus=1) for _ in range(2000)])
    await queue.enqueue_many(conn, [NewJob("train", tenant="b"), NewJob("train", tenant="b", gpus=1)])
    (shape,) = await queue.read_shapes(conn)
    await conn.execute("ANALYZE gpuq.jobs")
    for name, args in (("lease_fair", (["train"], ["b"], ["a#1"], 30)),
                       ("lease_placed_fair", (shape.kind, shape.digest, ["b"], ["a#1"], 30))):
        plan = await plans.explain(conn, queries[name], *args)
        used = plans.plan_indexes(plan)
        assert used & {"jobs_fair_idx", "jobs_fair_placed_idx"} and not used & {"jobs_pending_idx", "jobs_placed_idx"}, \
            (name, used)
        assert plans.plan_buffers(plan) < 60, (name, plans.plan_buffers(plan))
