"""What the dashboard reads about jobs: every attempt, and keyset-paginated lists that never walk history."""

import pytest

from gpuq import admin, plans, queue
from gpuq.jobs import JobFilter, NewJob, RetryFilter
from gpuq.sql import queries
from tests.helpers import add_pending, expire_leases, seed_history

LEASE = 30.0


async def _lease_one(conn, kind="train", agent="a#1"):
    got = await queue.lease(conn, [kind], 1, agent, LEASE)
    assert len(got.jobs) == 1
    return got.jobs[0]


async def test_every_attempt_that_did_not_succeed_is_kept_with_its_agent_and_error(conn):
    [job_id] = await queue.enqueue_many(conn, [NewJob("train", {"x": 1}, max_attempts=4)])
    first = await _lease_one(conn, agent="gpu-1#a")
    await queue.fail(conn, job_id, first.lease_token, "CUDA out of memory", retryable=True)
    await conn.execute("UPDATE gpuq.jobs SET status = 'pending' WHERE id = $1", job_id)  # its backoff is over

    second = await _lease_one(conn, agent="gpu-2#b")
    await expire_leases(conn, [job_id])
    assert (await queue.reclaim_expired(conn)).pending == [job_id]  # lost, not failed: no error of its own

    third = await _lease_one(conn, agent="gpu-3#c")
    assert await queue.complete(conn, job_id, third.lease_token, {"ok": True})

    tried = await admin.attempts(conn, job_id)
    assert [(a["attempt"], a["agent"], a["became"], a["error"]) for a in tried] == [
        (1, "gpu-1#a", "scheduled", "CUDA out of memory"),
        (2, "gpu-2#b", "pending", None),
    ]
    assert all(a["started_at"] <= a["ended_at"] for a in tried)
    shown = await admin.show(conn, job_id)
    assert (shown["attempts"], shown["leased_by"], shown["status"]) == (3, "gpu-3#c", "done")  # the last one
    assert second.attempt == 2


async def test_an_attempt_given_back_unstarted_or_completed_is_not_an_attempt_row(conn):
    [job_id] = await queue.enqueue_many(conn, [NewJob("train", {})])
    leased = await _lease_one(conn)
    await queue.release_unstarted(conn, [(job_id, leased.lease_token)])  # prefetched, never started
    leased = await _lease_one(conn)
    await queue.complete(conn, job_id, leased.lease_token, None)
    assert await admin.attempts(conn, job_id) == []


async def test_a_cancelled_running_job_and_a_dead_one_end_their_attempt(conn):
    ids = await queue.enqueue_many(conn, [NewJob("train", {}, max_attempts=1), NewJob("train", {})])
    got = await queue.lease(conn, ["train"], 2, "a#1", LEASE)
    tokens = {j.id: j.lease_token for j in got.jobs}
    await queue.fail(conn, ids[0], tokens[ids[0]], "boom", retryable=True)  # no attempts left: dead
    await admin.cancel(conn, ids[1])
    assert [(a["became"], a["error"]) for a in await admin.attempts(conn, ids[0])] == [("dead", "boom")]
    assert [(a["became"], a["error"]) for a in await admin.attempts(conn, ids[1])] == [("cancelled", "cancelled")]


async def test_retention_deletes_a_pruned_jobs_attempts(conn):
    [job_id] = await queue.enqueue_many(conn, [NewJob("train", {}, max_attempts=1)])
    leased = await _lease_one(conn)
    await queue.fail(conn, job_id, leased.lease_token, "boom")
    await conn.execute("UPDATE gpuq.jobs SET finished_at = now() - interval '2 days', "
                       "created_at = now() - interval '2 days' WHERE id = $1", job_id)
    deleted, _, _ = await queue.prune_window(conn, 0, 1000, 86400)
    assert deleted == 1
    assert await conn.fetchval("SELECT count(*) FROM gpuq.attempts") == 0


# -- lists -----------------------------------------------------------------


async def _mixed(conn):
    """done, dead, cancelled, scheduled, leased and pending jobs of two kinds; returns ids by state."""
    ids = await queue.enqueue_many(conn, [NewJob("train" if i % 2 else "eval", {"i": i}, max_attempts=1,
                                                       concurrency_key="k1" if i % 3 == 0 else None)
                                          for i in range(12)])
    got = await queue.lease(conn, ["train", "eval"], 6, "a#1", LEASE)
    leased = sorted(j.id for j in got.jobs)
    tokens = {j.id: j.lease_token for j in got.jobs}
    await queue.complete(conn, leased[0], tokens[leased[0]], None)
    await queue.fail(conn, leased[1], tokens[leased[1]], "CUDA out of memory")
    await queue.fail(conn, leased[2], tokens[leased[2]], "segfault")
    await admin.cancel(conn, leased[3])
    return {"done": [leased[0]], "dead": [leased[2], leased[1]], "cancelled": [leased[3]],
            "leased": [leased[5], leased[4]], "pending": sorted(set(ids) - set(leased), reverse=True)}


async def _ids(conn, **filters):
    return [j["id"] for j in (await admin.list_jobs(conn, JobFilter(**filters))).jobs]


async def test_each_state_lists_its_jobs_newest_first(conn):
    by_state = await _mixed(conn)
    for state, expected in by_state.items():
        assert await _ids(conn, state=state) == expected, state
    assert await _ids(conn, state="failed") == sorted(by_state["dead"] + by_state["cancelled"], reverse=True)
    everything = await _ids(conn)
    assert everything == sorted(everything, reverse=True) and len(everything) == 12


async def test_filters_by_kind_key_and_error_text(conn):
    by_state = await _mixed(conn)
    assert await _ids(conn, error="out of memory") == [by_state["dead"][1]]
    assert await _ids(conn, state="dead", error="segfault") == [by_state["dead"][0]]
    for state, kind, key in ((None, "eval", "k1"), ("pending", "eval", "k1"), ("failed", "train", None),
                             ("failed", "eval", None)):
        listed = (await admin.list_jobs(conn, JobFilter(state=state, kind=kind, key=key))).jobs
        assert listed and all(j["kind"] == kind and key in (None, j["concurrency_key"]) for j in listed)
        everything = (await admin.list_jobs(conn, JobFilter(state=state))).jobs
        assert len(listed) < len(everything)
    with pytest.raises(ValueError, match="state must be one of"):
        JobFilter(state="running")


async def test_keyset_pages_cover_every_job_once(conn):
    await seed_history(conn, 120)
    pending = await add_pending(conn, 30)
    seen, before = [], None
    while True:
        page = await admin.list_jobs(conn, JobFilter(), before=before, limit=50)
        seen += [j["id"] for j in page.jobs]
        if page.older is None:
            break
        before = page.older
    assert seen == sorted(set(range(1, 121)) | set(pending), reverse=True)


async def test_a_filter_that_matches_nothing_walks_one_window_per_page(conn, monkeypatch):
    monkeypatch.setattr(admin, "LIST_WINDOW", 100)
    await seed_history(conn, 250)
    page = await admin.list_jobs(conn, JobFilter(kind="nothing-like-this"))
    assert (page.jobs, page.older, page.searched_to) == ([], 151, 151)  # ids 151..250 looked at
    page = await admin.list_jobs(conn, JobFilter(kind="nothing-like-this"), before=151)
    assert (page.older, page.searched_to) == (51, 51)
    page = await admin.list_jobs(conn, JobFilter(kind="nothing-like-this"), before=51)
    assert (page.older, page.searched_to) == (None, None)  # reached the first id


async def test_retry_by_state_and_key(conn):
    by_state = await _mixed(conn)
    assert await admin.retry_count(conn, RetryFilter(state="cancelled")) == 1
    assert await admin.retry_count(conn, RetryFilter(state="dead")) == 2
    with pytest.raises(ValueError, match="dead or cancelled"):
        RetryFilter(state="done").args()
    assert await admin.retry(conn, RetryFilter(state="dead", error="segfault")) == 1
    assert await _ids(conn, state="dead") == [by_state["dead"][1]]


# -- the history guard ---------------------------------------------------------


async def _live_slice(conn):
    """What an operator looks at: pending, leased, scheduled, dead and cancelled jobs; returns a dead job's id."""
    await add_pending(conn, 200)
    await add_pending(conn, 20, kind="eval")
    got = await queue.lease(conn, ["eval"], 20, "a#1", LEASE)
    jobs = got.jobs
    for j in jobs[:10]:
        await queue.fail(conn, j.id, j.lease_token, "CUDA out of memory", retryable=True)  # scheduled
    await conn.execute("UPDATE gpuq.jobs SET max_attempts = attempts WHERE id = ANY($1::bigint[])",
                       [j.id for j in jobs[10:15]])
    for j in jobs[10:15]:
        await queue.fail(conn, j.id, j.lease_token, "segfault")  # dead
    await admin.cancel(conn, *[j.id for j in jobs[15:17]])
    await conn.execute("INSERT INTO gpuq.jobs (kind, concurrency_key, status, finished_at) "
                       "SELECT 'train', 'k9', s::gpuq.job_status, CASE WHEN s = 'done' THEN now() END "
                       "FROM unnest(ARRAY['done', 'pending', 'done']) s")
    return jobs[10].id


def _pages(top: int, dead_id: int) -> dict[str, list[tuple[str, tuple]]]:
    """Every page of the dashboard that reads the jobs table: the statements it runs, with their parameters."""
    pages = {}
    for label, which in {
        "list: all": JobFilter(), "list: kind": JobFilter(kind="train"), "list: pending": JobFilter(state="pending"),
        "list: leased": JobFilter(state="leased"), "list: scheduled": JobFilter(state="scheduled"),
        "list: dead": JobFilter(state="dead"), "list: failed of a kind": JobFilter(state="failed", kind="eval"),
        "list: error text": JobFilter(state="failed", error="segfault"), "list: key": JobFilter(key="k9"),
        "list: done of a key": JobFilter(state="done", key="k9"),
    }.items():
        indexed = admin._indexed(which)
        pages[label] = [*([] if indexed else [("max_job_id", ())]),
                        admin.list_statement(which, None if indexed else top, 50)]
    pages["list: dead"].append(("last_agents", ([dead_id],)))  # a failed job's agent, from its attempts
    pages["job page"] = [("show", (dead_id,)), ("job_attempts", (dead_id,))]
    pages["retry preview"] = [("retry_count", RetryFilter(kind="eval", state="dead").args())]
    pages["overview"] = [("status_counts", ()), ("table_estimate", ()), ("paused_kinds", ()), ("placed_pending", ())]
    return pages


async def _buffers(conn) -> dict[str, tuple[int, set[str]]]:
    await conn.execute("ANALYZE gpuq.jobs")
    top = await conn.fetchval("SELECT max(id) + 1 FROM gpuq.jobs")
    dead_id = await conn.fetchval("SELECT max(id) FROM gpuq.jobs WHERE status = 'dead'")
    out = {}
    for label, statements in _pages(top, dead_id).items():
        buffers, indexes = 0, set()
        for name, args in statements:
            plan = await plans.explain_warm(conn, queries[name], *args)
            buffers += plans.plan_buffers(plan)
            indexes |= plans.plan_indexes(plan)
        out[label] = (buffers, indexes)
    return out


async def test_the_dashboards_reads_cost_the_same_at_a_million_done_rows(conn):
    """The jobs list, the job page and the overview read no more at 1M done rows than at none (1.5x)."""
    await _live_slice(conn)
    empty = await _buffers(conn)

    await conn.execute("TRUNCATE gpuq.jobs, gpuq.attempts RESTART IDENTITY")
    await seed_history(conn, 1_000_000)
    await _live_slice(conn)  # the live jobs sit above the whole done prefix
    full = await _buffers(conn)

    for label, (buffers, indexes) in full.items():
        assert not any(i.startswith("seqscan:") for i in indexes), (label, indexes)
        # A lookup by id descends a B-tree one or two levels deeper at 1M rows
        # (log of the table): +2 buffers per descent, never a walk of history.
        assert buffers <= empty[label][0] * 1.5, (label, empty[label][0], buffers)
    assert "jobs_failed_idx" in full["list: dead"][1] and "jobs_failed_idx" in full["list: error text"][1]
    assert "jobs_leased_idx" in full["list: leased"][1] and "jobs_pkey" in full["list: all"][1]
    assert "jobs_keyed_idx" in full["list: key"][1] and "jobs_keyed_idx" in full["list: done of a key"][1]
    assert "jobs_failed_idx" in full["retry preview"][1]
    print({label: (empty[label][0], full[label][0]) for label in full})


async def _window_walk_buffers(conn) -> int:
    """A page whose filter matches nothing: it walks one window of ids, then stops."""
    await conn.execute("ANALYZE gpuq.jobs")
    top = await conn.fetchval("SELECT max(id) + 1 FROM gpuq.jobs")
    name, args = admin.list_statement(JobFilter(kind="nobody-runs-this"), top, 50)
    await plans.explain(conn, queries[name], *args)
    return plans.plan_buffers(await plans.explain(conn, queries[name], *args))


async def test_a_filter_that_matches_nothing_reads_one_window_however_long_the_history(conn):
    await seed_history(conn, 2 * admin.LIST_WINDOW)
    short = await _window_walk_buffers(conn)
    await seed_history(conn, 500_000)
    long = await _window_walk_buffers(conn)
    assert long <= short * 1.5, (short, long)
