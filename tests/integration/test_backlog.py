"""The backlog per kind and placement shape (gpuq_pending_jobs, gpuq_pending_oldest_seconds): right, and
read by index probes whatever the backlog."""

import anyio
from prometheus_client.parser import text_string_to_metric_families

from gpuq import admin, backlog, census, plans
from gpuq.backlog import read_backlog
from gpuq.harness import http_get, running_server
from gpuq.sql import queries
from tests.helpers import add_pending, seed_history, wait_count, wait_for


async def _placed(conn, n: int, kind: str, gpus: int, model: str | None = None, labels: tuple[str, ...] = (),
                  priority: int = 0, ago_seconds: float = 0) -> None:
    await conn.execute(
        "INSERT INTO gpuq.jobs (kind, gpus, model, labels, priority, run_at) "
        "SELECT $1, $2, $3, $4::text[], $5, now() - make_interval(secs => $6) FROM generate_series(1, $7)",
        kind, gpus, model, list(labels), priority, ago_seconds, n)


def _by_key(rows):
    return {(b.shape.kind, b.shape.gpus, b.shape.model): b for b in rows}


async def test_backlog_counts_each_kind_and_shape_and_the_longest_wait(conn, monkeypatch):
    await seed_history(conn, 500)
    await add_pending(conn, 4, kind="embed")
    await add_pending(conn, 2, kind="embed", priority=5)
    # A low-priority job that has waited two minutes: the oldest, behind the higher levels.
    await conn.execute("INSERT INTO gpuq.jobs (kind, priority, run_at) VALUES ('embed', -3, now() - interval '120 s')")
    await _placed(conn, 3, "infer", 1, model="llama", ago_seconds=30)
    await _placed(conn, 2, "infer", 2, labels=("gpu=h100",), priority=1, ago_seconds=7)
    await _placed(conn, 1, "infer", 2, labels=("gpu=h100",), ago_seconds=9)
    await _placed(conn, 1, "train", 8)  # then leased, and a shape nobody waits for any more
    await conn.execute("UPDATE gpuq.jobs SET status = 'leased', lease_token = gen_random_uuid(), leased_by = 'a', "
                       "lease_expires_at = now() + interval '1 min' WHERE kind = 'train'")
    await conn.execute("INSERT INTO gpuq.jobs (kind, status, run_at) VALUES ('later', 'scheduled', now() + interval '1h')")

    got = _by_key(await read_backlog(conn))
    assert set(got) == {("embed", 0, None), ("infer", 1, "llama"), ("infer", 2, None), ("train", 8, None)}
    embed, llama, h100, train = (got[k] for k in (("embed", 0, None), ("infer", 1, "llama"), ("infer", 2, None),
                                                  ("train", 8, None)))
    assert (embed.shape.plain, embed.pending, embed.oldest_seconds) == (True, 7, 120.0)
    assert (llama.pending, llama.oldest_seconds) == (3, 30.0)
    assert (h100.pending, h100.oldest_seconds, h100.shape.labels) == (3, 9.0, frozenset({"gpu=h100"}))
    assert (train.pending, train.oldest_seconds) == (0, None)

    # The count stops at the cap; the age looks at the highest MAX_LEVELS priority levels only.
    monkeypatch.setattr(backlog, "COUNT_CAP", 5)
    monkeypatch.setattr(backlog, "MAX_LEVELS", 2)
    embed = _by_key(await read_backlog(conn))[("embed", 0, None)]
    assert (embed.pending, embed.oldest_seconds) == (5, 0.0)


async def test_a_backlog_read_touches_index_pages_not_the_backlog(conn):
    """100,000 pending jobs over two kinds and two shapes, and history: the read is a few index
    descents per kind and shape and at most COUNT_CAP entries each, never every pending entry."""
    await seed_history(conn, 20_000)
    await conn.execute("INSERT INTO gpuq.jobs (kind, priority) "
                       "SELECT CASE WHEN g % 3 = 0 THEN 'embed' ELSE 'train' END, g % 4 FROM generate_series(1, 95000) g")
    await _placed(conn, 4_990, "infer", 1, model="llama")
    await _placed(conn, 10, "infer", 4, labels=("gpu=h100",))
    plan = await plans.explain(conn, queries["backlog"], backlog.COUNT_CAP, backlog.MAX_LEVELS)
    used = plans.plan_indexes(plan)
    # The fair-share indexes hold the same pending rows, by kind first: the planner may take them.
    assert used <= {"jobs_pending_idx", "jobs_placed_idx", "jobs_fair_idx", "jobs_fair_placed_idx", "shapes_pkey"}, used
    # Two kinds and two shapes: a descent per priority level and the first 1,000 index
    # entries of each, with their heap pages (none vacuumed yet, and the kinds' rows
    # interleaved): 365 buffers measured. An exact count read 9,500.
    assert plans.plan_buffers(plan) < 4 * 150


def _series(text: str, name: str) -> dict[tuple[str, str, str], float]:
    """(kind, gpus, model) -> value of one metric family."""
    [family] = [f for f in text_string_to_metric_families(text) if f.name == name]
    return {(s.labels["kind"], s.labels.get("gpus", ""), s.labels.get("model", "")): s.value for s in family.samples}


async def _scrape_until(srv, check) -> str:
    """The first /metrics text ``check`` accepts: the gauges follow the census's next read (gpuq.census)."""
    text = [""]

    async def passes() -> bool:
        text[0] = (await http_get(srv.http + "/metrics"))[2]
        return check(text[0])

    await wait_for(passes)
    return text[0]


async def test_metrics_show_the_backlog_and_paused_kinds_and_zero_once_the_backlog_is_gone(dsn, pool, monkeypatch):
    monkeypatch.setattr(census, "LOAD_SHARE", 1.0)  # a read every 0.05 s, however slow this machine's reads are
    async with running_server(dsn, metrics_sample_seconds=0.05) as srv:
        await pool.execute("INSERT INTO gpuq.jobs (kind, run_at) "
                           "SELECT 'scale-me', now() - interval '1 min' FROM generate_series(1, 6)")
        await _placed(pool, 2, "scale-gpu", 2, model="llama", ago_seconds=5)
        text = await _scrape_until(srv, lambda t: ("scale-gpu", "2", "llama") in _series(t, "gpuq_pending_jobs"))
        pending = _series(text, "gpuq_pending_jobs")
        assert pending[("scale-me", "0", "")] == 6 and pending[("scale-gpu", "2", "llama")] == 2
        assert _series(text, "gpuq_pending_oldest_seconds")[("scale-me", "0", "")] >= 60
        assert not _series(text, "gpuq_kind_paused")
        # A paused kind's jobs are not leased: a series says so, for autoscalers to leave them out.
        await admin.pause(pool, "scale-me", "test")
        await _scrape_until(srv, lambda t: _series(t, "gpuq_kind_paused") == {("scale-me", "", ""): 1})
        await admin.resume(pool, "scale-me")
        await pool.execute("DELETE FROM gpuq.jobs WHERE kind IN ('scale-me', 'scale-gpu')")
        text = await _scrape_until(srv, lambda t: not _series(t, "gpuq_pending_jobs")[("scale-me", "0", "")])
        pending, oldest = _series(text, "gpuq_pending_jobs"), _series(text, "gpuq_pending_oldest_seconds")
        assert not _series(text, "gpuq_kind_paused")
        for key in (("scale-me", "0", ""), ("scale-gpu", "2", "llama")):
            assert pending[key] == 0 and oldest[key] == 0, key


async def _inflight(srv, kind: str) -> float | None:
    [family] = [f for f in text_string_to_metric_families((await http_get(srv.http + "/metrics"))[2])
                if f.name == "gpuq_jobs_inflight_by_kind"]
    return next((s.value for s in family.samples if s.labels["kind"] == kind), None)


async def test_metrics_count_the_jobs_agents_hold_per_kind(dsn, pool):
    """What an autoscaler adds to the backlog: the jobs running (or held) on the agents it would
    scale down. Every kind a connected agent takes has a series, 0 when it holds none."""
    release = anyio.Event()

    async def hold(job):
        await release.wait()

    async with running_server(dsn) as srv:
        async def holds(n: int) -> bool:
            return await _inflight(srv, "held") == n

        await srv.agent(["held"], 2, hold)
        assert await holds(0)
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'held' FROM generate_series(1, 2)")
        await wait_for(lambda: holds(2))
        release.set()
        await wait_count(pool, "done", 2)
        await wait_for(lambda: holds(0))
