"""Completion, failure, heartbeat, release and cancel: all fenced by the lease."""

from datetime import timedelta

from gpuq import admin, plans, queue
from gpuq.jobs import JobBackoff
from gpuq.sql import queries
from tests.helpers import add_pending, job

LEASE = 30.0


async def _lease_one(conn, agent="a#1"):
    [jid] = await add_pending(conn, 1)
    [leased] = (await queue.lease(conn, ["train"], 1, agent, LEASE)).jobs
    return leased


async def test_complete_many_is_one_batch_and_fenced(conn):
    await add_pending(conn, 3)
    jobs = (await queue.lease(conn, ["train"], 3, "a#1", LEASE)).jobs
    stale = "00000000-0000-0000-0000-000000000000"
    accepted = await queue.complete_many(conn, [
        (jobs[0].id, jobs[0].lease_token, {"n": 0}),
        (jobs[1].id, jobs[1].lease_token, [1, 2]),
        (jobs[2].id, stale, {"n": 2}),
    ])
    assert accepted == {jobs[0].id, jobs[1].id}
    done = await job(conn, jobs[0].id)
    assert done["status"] == "done" and done["result"] == {"n": 0} and done["finished_at"] is not None
    assert (await job(conn, jobs[1].id))["result"] == [1, 2]
    rejected = await job(conn, jobs[2].id)
    assert rejected["status"] == "leased" and rejected["result"] is None


async def test_second_completion_of_a_done_job_is_rejected(conn):
    j = await _lease_one(conn)
    assert await queue.complete(conn, j.id, j.lease_token, {"first": True})
    assert not await queue.complete(conn, j.id, j.lease_token, {"second": True})
    assert (await job(conn, j.id))["result"] == {"first": True}


async def test_fail_with_stale_token_changes_nothing(conn):
    j = await _lease_one(conn)
    before = await job(conn, j.id)
    assert await queue.fail(conn, j.id, "00000000-0000-0000-0000-000000000001", "boom") is None
    assert dict(await job(conn, j.id)) == dict(before)


async def test_retryable_failure_backs_off_into_scheduled(conn):
    j = await _lease_one(conn)
    now = await conn.fetchval("SELECT now()")
    out = await queue.fail(conn, j.id, j.lease_token, "CUDA OOM", True, JobBackoff(10, 300, 0.5))
    assert out is not None and out.status == "scheduled"
    row = await job(conn, j.id)
    assert row["status"] == "scheduled" and row["last_error"] == "CUDA OOM"
    assert row["lease_token"] is None and row["leased_by"] is None
    # attempt 1: base 10s, jitter in [0.5, 1] -> 5..10 s in the future
    assert now + timedelta(seconds=4.9) <= row["run_at"] <= now + timedelta(seconds=10.5)


async def test_backoff_grows_exponentially_and_is_capped(conn):
    delays = []
    for attempt in range(1, 5):
        [jid] = await add_pending(conn, 1, kind=f"k{attempt}")
        await conn.execute("UPDATE gpuq.jobs SET attempts = $2 - 1, max_attempts = 10 WHERE id = $1",
                           jid, attempt)
        [j] = (await queue.lease(conn, [f"k{attempt}"], 1, "a#1", LEASE)).jobs
        assert j.attempt == attempt
        now = await conn.fetchval("SELECT now()")
        out = await queue.fail(conn, j.id, j.lease_token, "x", True, JobBackoff(1, 5, 0.0))
        delays.append(round((out.run_at - now).total_seconds()))
    assert delays == [1, 2, 4, 5]


async def test_non_retryable_and_exhausted_failures_go_dead(conn):
    j = await _lease_one(conn)
    out = await queue.fail(conn, j.id, j.lease_token, "bad input", retryable=False)
    assert out.status == "dead"
    row = await job(conn, j.id)
    assert row["status"] == "dead" and row["last_error"] == "bad input" and row["finished_at"]

    jid = await conn.fetchval("INSERT INTO gpuq.jobs (kind, max_attempts) VALUES ('last', 1) RETURNING id")
    [last] = (await queue.lease(conn, ["last"], 1, "a#1", LEASE)).jobs
    assert (await queue.fail(conn, jid, last.lease_token, "again", retryable=True)).status == "dead"


async def test_heartbeat_extends_only_the_agents_own_leases(conn):
    mine = await _lease_one(conn, "a#1")
    theirs = await _lease_one(conn, "b#1")
    before = (await job(conn, mine.id))["lease_expires_at"]
    assert await queue.heartbeat(conn, [mine.id, theirs.id], "a#1", 600) == {mine.id}
    assert (await job(conn, mine.id))["lease_expires_at"] > before + timedelta(seconds=500)
    assert (await job(conn, theirs.id))["lease_expires_at"] < before + timedelta(seconds=60)


async def test_release_agent_returns_its_jobs_and_counts_the_attempt(live_conn, notifications):
    await add_pending(live_conn, 2)
    a_jobs = (await queue.lease(live_conn, ["train"], 2, "a#1", LEASE)).jobs
    b = await _lease_one(live_conn, "b#1")
    await notifications.drain(0.1)  # the inserts' own notifications
    moved = await queue.release_agent(live_conn, "a#1", started=[j.id for j in a_jobs])
    assert sorted(moved.pending) == sorted(j.id for j in a_jobs) and moved.dead == []
    for j in a_jobs:
        row = await job(live_conn, j.id)
        assert row["status"] == "pending" and row["attempts"] == 1 and row["lease_token"] is None
    assert (await job(live_conn, b.id))["status"] == "leased"
    assert await notifications.next() == "train!"  # back to pending: behind any lease cursor
    # The released job's old token can no longer complete it.
    assert not await queue.complete(live_conn, a_jobs[0].id, a_jobs[0].lease_token, None)


async def test_release_of_a_last_attempt_ends_dead(conn):
    jid = await conn.fetchval("INSERT INTO gpuq.jobs (kind, max_attempts) VALUES ('train', 1) RETURNING id")
    await queue.lease(conn, ["train"], 1, "a#1", LEASE)
    moved = await queue.release_agent(conn, "a#1", started=[jid])
    assert moved.dead == [jid]
    row = await job(conn, jid)
    assert row["status"] == "dead" and "disconnected" in row["last_error"]


async def test_a_job_that_never_started_goes_back_without_its_attempt_even_on_its_last(conn):
    never, orphan = [await conn.fetchval("INSERT INTO gpuq.jobs (kind, max_attempts) VALUES ('train', 1) "
                                         "RETURNING id") for _ in range(2)]
    await queue.lease(conn, ["train"], 2, "a#1", LEASE)
    await conn.execute("UPDATE gpuq.jobs SET leased_by = 'b#1' WHERE id = $1", orphan)
    assert (await queue.release_agent(conn, "a#1", started=[])).pending == [never]  # prefetched, or in flight
    assert (await queue.release_jobs(conn, [orphan], undelivered=True)).pending == [orphan]  # never pushed
    for jid in (never, orphan):
        row = await job(conn, jid)
        assert (row["status"], row["attempts"]) == ("pending", 0)


async def test_cancel_live_job_fences_out_the_running_agent(conn):
    j = await _lease_one(conn)
    assert await admin.cancel(conn, j.id) == {j.id: "leased"}
    assert not await queue.complete(conn, j.id, j.lease_token, {"late": 1})
    assert not await queue.fail(conn, j.id, j.lease_token, "late", retryable=True)  # never retried
    row = await job(conn, j.id)
    assert row["status"] == "cancelled" and row["last_error"] == "cancelled"
    assert await admin.cancel(conn, j.id) == {}  # already finished


async def test_cancel_takes_pending_and_scheduled_jobs_and_skips_finished_ones(conn):
    done = await _lease_one(conn)
    assert await queue.complete(conn, done.id, done.lease_token, None)
    [pending] = await add_pending(conn, 1)
    later = await conn.fetchval("INSERT INTO gpuq.jobs (kind, status, run_at) "
                                "VALUES ('train', 'scheduled', now() + interval '1h') RETURNING id")
    got = await conn.fetch("SELECT * FROM gpuq.cancel($1::bigint[]) ORDER BY id",  # the plain-SQL way
                           [pending, later, done.id, 10**9])
    assert [(r["id"], r["was"]) for r in got] == [(pending, "pending"), (later, "scheduled")]
    assert (await queue.lease(conn, ["train"], 10, "a#1", LEASE)).jobs == []  # cancelled: never leased


async def test_completer_isolates_an_outcome_the_database_refuses(pool):
    import json as _json

    from gpuq.dispatcher import AgentSession, Dispatcher
    from gpuq.harness import server_config
    from gpuq.protocol import Done, Hello, encode
    from gpuq.protocol.server_side import ServerProtocol

    async with pool.acquire() as conn:
        await add_pending(conn, 2)
        jobs = (await queue.lease(conn, ["train"], 2, "s#1", LEASE)).jobs
    sent: list[str] = []

    d = Dispatcher(pool, server_config("unused"))
    proto = ServerProtocol(max_payload=1 << 20, max_messages_per_second=100, now=0.0)
    proto.receive(encode(Hello("s", ("train",), 2)), 0.0)
    session = AgentSession(proto, flush=lambda: sent.extend(proto.frames_to_send()), id="s#1")
    d.completer.done += [(session, Done(jobs[0].id, jobs[0].lease_token, {"t": "nul\x00"}), "train"),
                         (session, Done(jobs[1].id, jobs[1].lease_token, {"t": "fine"}), "train")]
    await d.completer.flush()
    acks = [_json.loads(f) for f in sent]
    assert {i for a in acks for i in a["accepted"]} == {jobs[1].id}
    assert {i for a in acks for i in a["rejected"]} == {jobs[0].id}
    assert await pool.fetchval("SELECT status::text FROM gpuq.jobs WHERE id = $1", jobs[1].id) == "done"
    assert await pool.fetchval("SELECT status::text FROM gpuq.jobs WHERE id = $1", jobs[0].id) == "leased"


async def _explain(conn, statement, *args):
    """(buffers, indexes scanned) of one rolled-back EXPLAIN ANALYZE run."""
    plan = await plans.explain(conn, statement, *args)
    return plans.plan_buffers(plan), plans.plan_indexes(plan)


async def test_outcomes_and_heartbeats_cost_o_batch_however_many_jobs_are_leased(conn):
    """Statistics say nothing is leased (ANALYZE ran before the leases); 4,000 are.

    Fenced by a plain status = 'leased', the planner read every leased row
    from jobs_leased_idx to settle 10 jobs; by id it reads about 10 rows.
    """
    await add_pending(conn, 4000)
    await conn.execute("ANALYZE gpuq.jobs")
    jobs = []
    while len(jobs) < 4000:
        jobs += (await queue.lease_slots(conn, ["train"], ["a#1"] * 256, LEASE)).jobs
    ten = jobs[:10]
    ids, tokens = [j.id for j in ten], [j.lease_token for j in ten]
    b = JobBackoff()
    for statement, args in ((queries["complete_many"], (ids, tokens, [None] * 10)),
                            (queries["fail_many"], (ids, tokens, ["x"] * 10, [True] * 10, b.base_seconds,
                                                b.cap_seconds, b.jitter)),
                            (queries["heartbeat"], (ids, "a#1", LEASE)),
                            (queries["release_jobs"], (ids, "released", False))):
        await _explain(conn, statement, *args)  # warm the plan and the caches
        buffers, indexes = await _explain(conn, statement, *args)
        assert "jobs_leased_idx" not in indexes and "jobs_pkey" in indexes, (statement, indexes)
        assert buffers < 300, (statement, buffers)  # 4,000 leased rows span ~60 heap pages + index

