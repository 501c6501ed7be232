"""Checkpoints (issue #33, part 1) on a real PostgreSQL: every lease statement returns a job's
checkpoint and every way back to pending keeps it; an agent stores one, dies, and the job resumes
from it elsewhere; a late one from a lease that was reclaimed is refused; the agent's interval
coalesces them and flushes the latest before the outcome; a program run with run_process does the same."""

import json
import sys
import threading

import anyio

import gpuq
from gpuq import admin, queue
from gpuq.agent import Agent, run_process
from gpuq.harness import TOKEN, next_of, raw_agent, running_server
from gpuq.jobs import RetryFilter, Shape
from gpuq.testing import run_job
from tests.helpers import add_pending, expire_leases, wait_for, wait_status
from tests.integration.test_ui import READ, UI, login, request


async def lease_one(pool, kind: str = "ck"):
    [job] = (await queue.lease(pool, [kind], 1, "a#1", 30)).jobs
    return job


def resumes(job) -> object:
    return None if job.resume_json is None else json.loads(job.resume_json)


async def store(pool, job, data) -> set[int]:
    return await queue.record_checkpoints(pool, [(job.id, job.lease_token, json.dumps(data))])


async def test_every_way_back_to_pending_keeps_the_checkpoint_and_the_lease_returns_it(pool, live_conn):
    [job_id] = await add_pending(live_conn, 1, "ck")
    await live_conn.execute("UPDATE gpuq.jobs SET max_attempts = 20 WHERE id = $1", job_id)
    job = await lease_one(pool)
    assert resumes(job) is None
    assert await store(pool, job, {"step": 1}) == {job_id}
    await queue.release_agent(pool, "a#1", [job_id])  # the agent disconnected
    job = await lease_one(pool)
    assert resumes(job) == {"step": 1} and job.attempt == 2
    assert await store(pool, job, {"step": 2}) == {job_id}
    await expire_leases(live_conn, [job_id])
    [job] = (await queue.lease_slots(pool, ["ck"], ["b#1"], 30)).jobs  # phase 2: an expired lease, taken over
    assert resumes(job) == {"step": 2} and job.leased_by == "b#1"
    await queue.fail(pool, job.id, job.lease_token, "oom", retryable=True)  # scheduled, then due
    await live_conn.execute("UPDATE gpuq.jobs SET run_at = now() WHERE id = $1", job_id)
    await queue.promote_due(pool)
    job = await lease_one(pool)
    assert resumes(job) == {"step": 2}
    await store(pool, job, {"step": 3})
    await expire_leases(live_conn, [job_id])
    await queue.reclaim_expired(pool)  # the sweeper
    job = await lease_one(pool)
    await queue.release_unstarted(pool, [(job.id, job.lease_token)])
    job = await lease_one(pool)
    await queue.release_jobs(pool, [job_id])  # a server's shutdown
    job = await lease_one(pool)
    assert resumes(job) == {"step": 3}
    assert await queue.record_checkpoints(pool, [(job_id, "11111111-1111-1111-1111-111111111111", "4")]) == set()
    await queue.fail(pool, job.id, job.lease_token, "bad input", retryable=False)  # dead
    assert await store(pool, job, {"step": 99}) == set()  # no longer leased: fenced
    shown = await gpuq.show(pool, job_id)
    assert shown["status"] == "dead" and shown["checkpoint"] == {"step": 3} and shown["checkpoint_attempt"] == 4
    assert await admin.retry(pool, RetryFilter(ids=[job_id])) == 1  # keeps it
    job = await lease_one(pool)
    assert resumes(job) == {"step": 3} and job.attempt == 1
    await queue.fail(pool, job.id, job.lease_token, "bad checkpoint", retryable=False)
    assert await admin.retry(pool, RetryFilter(ids=[job_id]), fresh=True) == 1
    assert resumes(await lease_one(pool)) is None
    assert (await gpuq.show(pool, job_id))["checkpoint_at"] is None


async def test_the_placed_limited_and_batched_leases_return_the_checkpoint(pool, live_conn):
    placed_id = await gpuq.enqueue(pool, "ckgpu", {}, gpus=1)
    [shape] = [s for s in await queue.read_shapes(pool) if s.kind == "ckgpu"]
    [job] = await queue.lease_placed(pool, shape, ["a#1"], 30)
    await store(pool, job, "placed")
    await queue.release_jobs(pool, [placed_id])
    [job] = await queue.lease_placed(pool, shape, ["a#1"], 30)
    assert resumes(job) == "placed"

    [limited_id] = await add_pending(live_conn, 1, "cklim")
    await admin.set_limit(pool, "kind", "cklim", 5)
    [job] = await queue.lease_limited(pool, Shape.of_plain("cklim"), ["a#1"], 30, scan_keys=False)
    await store(pool, job, ["limited"])
    await queue.release_jobs(pool, [limited_id])
    [job] = await queue.lease_limited(pool, Shape.of_plain("cklim"), ["a#1"], 30, scan_keys=False)
    assert resumes(job) == ["limited"]

    [batched_id] = await add_pending(live_conn, 1, "ckbat")
    job = (await queue.lease_batched(pool, "ckbat", [("a#1", [batched_id])], 30))[batched_id]
    await store(pool, job, 7)
    await queue.release_jobs(pool, [batched_id])
    job = (await queue.lease_batched(pool, "ckbat", [("a#1", [batched_id])], 30))[batched_id]
    assert resumes(job) == 7 and job.batch == batched_id


async def test_on_the_wire_a_version_9_agent_resumes_and_checkpoints_a_version_8_one_sees_nothing_new(dsn, pool):
    ids = [await pool.fetchval("INSERT INTO gpuq.jobs (kind, checkpoint) VALUES ('embed', $1::text::jsonb) RETURNING id",
                               json.dumps({"step": i})) for i in (8, 9)]
    described = {"devices": [], "labels": [], "models": [], "prefetch": 0, "batch": 0}
    async with running_server(dsn) as srv:
        old, _ = await raw_agent(srv, name="old", protocol=8, **described)
        [to_old] = (await next_of(old, "jobs"))["jobs"]
        item = {"id": to_old["id"], "lease_token": to_old["lease_token"], "seq": 1, "data": {"step": 80}}
        await old.send(json.dumps({"type": "checkpoint", "checkpoints": [item]}))
        refused = await next_of(old, "error")
        new, _ = await raw_agent(srv, name="new", protocol=9, **described)
        [to_new] = (await next_of(new, "jobs"))["jobs"]
        mine = {"id": to_new["id"], "lease_token": to_new["lease_token"], "seq": 7, "data": {"step": 90}}
        stale = {**mine, "lease_token": to_old["lease_token"], "seq": 8}
        await new.send(json.dumps({"type": "checkpoint", "checkpoints": [mine, stale]}))
        first = await next_of(new, "checkpointed")  # the stale one at once, without the database
        second = await next_of(new, "checkpointed")
        for ws in (old, new):
            await ws.close()
    assert (to_old["id"], to_new["id"]) == tuple(ids) and "resume_from" not in to_old
    assert to_new["resume_from"] == {"step": 9}
    assert refused["code"] == "unexpected"
    assert first == {"type": "checkpointed", "stored": [], "refused": [8]}
    assert second == {"type": "checkpointed", "stored": [7], "refused": []}
    assert [(await gpuq.show(pool, i))["checkpoint"] for i in ids] == [{"step": 8}, {"step": 90}]


async def test_a_job_resumes_elsewhere_from_what_its_agent_stored_before_it_died(dsn, pool):
    stored = anyio.Event()
    resumed: list[object] = []

    async def first(job):
        assert job.resume_from is None
        if await job.checkpoint({"step": 50, "weights": "s3://bucket/run/50.pt"}):
            stored.set()
        await anyio.sleep_forever()

    async def second(job):
        resumed.append(job.resume_from)
        return job.attempt

    async with running_server(dsn, poll_seconds=60, **UI) as srv:
        async with anyio.create_task_group() as dies:
            doomed = Agent(srv.url, TOKEN, ["train"], 1, first, "doomed", devices=(), prefetch=0)
            dies.start_soon(doomed.run)
            job_id = await gpuq.enqueue(pool, "train", {})
            with anyio.fail_after(10):
                await stored.wait()
            dies.cancel_scope.cancel()  # the agent's process is gone: its connection drops
        await srv.agent(["train"], 1, second, "survivor")
        await wait_status(pool, job_id, "done")
        session = {"Cookie": await login(srv.port, READ)}
        _, _, page = await request(srv.port, "GET", f"/ui/jobs/{job_id}", session)
    assert resumed == [{"step": 50, "weights": "s3://bucket/run/50.pt"}]
    shown = await gpuq.show(pool, job_id)
    assert shown["result"] == 2 and shown["checkpoint"]["step"] == 50 and shown["checkpoint_attempt"] == 1
    assert 'id="job-checkpoint"' in page and "s3://bucket/run/50.pt" in page and "stored by attempt 1" in page


async def test_a_late_checkpoint_from_a_lease_that_was_reclaimed_is_refused(dsn, pool, live_conn):
    first_stored, late_go = threading.Event(), threading.Event()
    answers: list[object] = []
    resumed: list[object] = []
    taken_over = anyio.Event()

    def slow(job):  # a sync handler: its receipts are waited on in its thread
        answers.append(job.checkpoint({"step": 1}).wait(10))
        first_stored.set()
        late_go.wait(10)
        answers.append(job.checkpoint({"step": 2}).wait(10))  # its lease is someone else's now
        return "late"

    async def takes_over(job):
        resumed.append(job.resume_from)
        taken_over.set()
        await late_done.wait()
        return "resumed"

    late_done = anyio.Event()
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 1, slow, "slow", prefetch=0)
        job_id = await gpuq.enqueue(pool, "train", {})
        await anyio.to_thread.run_sync(first_stored.wait, 10)
        await srv.agent(["train"], 1, takes_over, "next")
        await expire_leases(live_conn, [job_id])
        await queue.reclaim_expired(pool)  # the sweeper: the slow agent's lease is gone
        with anyio.fail_after(10):
            await taken_over.wait()
        late_go.set()
        await wait_for(lambda: len(answers) == 2)
        late_done.set()
        await wait_status(pool, job_id, "done")
    assert answers == [True, False] and resumed == [{"step": 1}]
    shown = await gpuq.show(pool, job_id)
    assert shown["checkpoint"] == {"step": 1} and shown["result"] == "resumed"


async def test_the_interval_coalesces_and_the_latest_goes_before_the_outcome(dsn, pool):
    checkpointed, finish = anyio.Event(), anyio.Event()
    receipts = []

    async def train(job):
        receipts.append(await job.checkpoint({"step": 1}))
        receipts.extend(job.checkpoint({"step": s}) for s in (2, 3))  # within the interval: they wait
        checkpointed.set()
        await finish.wait()
        return "done"

    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 1, train, checkpoint_seconds=3600)
        job_id = await gpuq.enqueue(pool, "train", {})
        with anyio.fail_after(10):
            await checkpointed.wait()
        assert (await gpuq.show(pool, job_id))["checkpoint"] == {"step": 1}  # 2 and 3 wait for the hour
        finish.set()
        await wait_status(pool, job_id, "done")
        with anyio.fail_after(10):
            assert [receipts[0], await receipts[1], await receipts[2]] == [True, True, True]
    assert (await gpuq.show(pool, job_id))["checkpoint"] == {"step": 3}  # the latest, flushed first


CHILD = """
from gpuq.agent.process import checkpoint, resume_from
start = (resume_from() or {"step": 0})["step"]
for step in range(start + 1, start + 4):
    checkpoint({"step": step})
print(start)
"""


async def test_a_program_run_with_run_process_resumes_and_checkpoints():
    async def handle(job):
        out = await run_process(sys.executable, "-c", CHILD, job=job)
        return int(out.stdout)

    outcome = await anyio.to_thread.run_sync(lambda: run_job(handle, {}, resume_from={"step": 10}))
    assert outcome.result == 10 and outcome.checkpoints == ({"step": 11}, {"step": 12}, {"step": 13})
    assert outcome.stored_checkpoint == {"step": 13}
