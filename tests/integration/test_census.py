"""The census (gpuq.census): /metrics serves the last background read of the queue, so a scrape
costs the database nothing whatever the backlog, and the gauges say how old they are."""

from prometheus_client.parser import text_string_to_metric_families

from gpuq import admin, census, db
from gpuq.dispatcher import Tuning
from gpuq.harness import http_get, running_server
from tests.helpers import seed_history, wait_for

SERVER = "gpuq-census-test"  # application_name of the server's connections


def _values(text: str, name: str) -> dict[str, float]:
    """One family's samples, by their label values joined with ","."""
    [family] = [f for f in text_string_to_metric_families(text) if f.name == name]
    return {",".join(s.labels.values()): s.value for s in family.samples}


async def _jobs_blocks(conn) -> tuple[int, int]:
    """Buffers of gpuq.jobs read so far (hits and reads), by every backend whose statistics reached
    the shared counters: (its rows, heap and TOAST; its indexes)."""
    row = await conn.fetchrow(
        "SELECT heap_blks_read + heap_blks_hit + coalesce(toast_blks_read + toast_blks_hit, 0) AS rows, "
        "coalesce(idx_blks_read + idx_blks_hit, 0) AS indexes FROM pg_statio_user_tables "
        "WHERE schemaname = 'gpuq' AND relname = 'jobs'")
    return row["rows"], row["indexes"]


async def test_a_scrape_reads_nothing_of_a_backlog_of_100k_and_its_history(dsn, live_conn):
    """One scrape on an otherwise idle server (no poll, no sweep, no census read due), the
    server's buffer reads of gpuq.jobs counted from PostgreSQL's statistics: what its backends
    flush when they exit, after the scrape. A scrape that counted the live rows itself read
    11,800 buffers here. Fair share is on: the tenants' gauges are the census's too."""
    await live_conn.execute("ALTER TABLE gpuq.jobs SET (autovacuum_enabled = off)")  # its reads would count
    await admin.set_tenant(live_conn, "acme", 2)
    quiet = {"poll_seconds": 3600, "sweep_seconds": 3600, "metrics_sample_seconds": 3600}
    # Fair share's own reads (the tenants with work: a loose scan that reads the first row of each)
    # come once, at the start, not while the test counts.
    no_fair_reads = Tuning(fair_share_seconds=3600, fair_waiting_seconds=3600)
    async with running_server(f"{dsn}?application_name={SERVER}", tuning=no_fair_reads, **quiet) as srv:
        # The census read once before the server listened: the first scrape has every series.
        first = (await http_get(srv.http + "/metrics"))[2]
        assert _values(first, "gpuq_queue_depth") == {"pending": 0, "leased": 0, "scheduled": 0}
        assert _values(first, "gpuq_queue_sample_age_seconds")[""] >= 0  # not NaN: read
        await seed_history(live_conn, 20_000)
        await live_conn.execute("INSERT INTO gpuq.jobs (kind, priority, tenant) SELECT CASE WHEN g % 3 = 0 "
                                "THEN 'embed' ELSE 'train' END, g % 4, CASE WHEN g % 2 = 0 THEN 'acme' END "
                                "FROM generate_series(1, 100000) g")
        await live_conn.execute("INSERT INTO gpuq.jobs (kind, gpus, model) SELECT 'infer', 1, 'llama' "
                                "FROM generate_series(1, 5000)")
        await live_conn.execute("SELECT pg_stat_force_next_flush()")  # this connection's inserts: counted now
        before = await _jobs_blocks(live_conn)
        assert (await http_get(srv.http + "/metrics"))[0] == 200

    async def server_gone() -> bool:  # a backend flushes its statistics as it exits
        return not await live_conn.fetchval("SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                                            SERVER)

    await wait_for(server_gone)
    # What the server read of the table from its start to its stop, the scrape included: no row,
    # whatever the backlog. Of the indexes only what planning reads, independent of the backlog:
    # each of the server's backends reads each index's first pages as it first plans a statement
    # on gpuq.jobs (14-27 buffers an index measured, on an empty table as at 100,000 pending jobs,
    # as its pool grew to more or fewer connections; 41 a index with fair share's statements too).
    # Reading the backlog's entries would be thousands.
    rows, indexes = await _jobs_blocks(live_conn)
    n_indexes = await live_conn.fetchval("SELECT count(*) FROM pg_indexes WHERE schemaname = 'gpuq' "
                                         "AND tablename = 'jobs'")
    assert rows - before[0] == 0
    assert indexes - before[1] < 60 * n_indexes


async def test_the_gauges_follow_the_census_and_keep_their_last_values_while_it_fails(dsn, pool, monkeypatch):
    monkeypatch.setattr(census, "LOAD_SHARE", 1.0)  # a read every 0.05 s, however slow this machine's reads are
    async with running_server(dsn, metrics_sample_seconds=0.05) as srv:
        async def scrape() -> dict[str, float]:
            text = (await http_get(srv.http + "/metrics"))[2]
            return {**_values(text, "gpuq_queue_depth"), "age": _values(text, "gpuq_queue_sample_age_seconds")[""]}

        async def pending_is(n: int) -> bool:
            return (await scrape())["pending"] == n

        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'counted' FROM generate_series(1, 4)")
        await wait_for(lambda: pending_is(4))
        # The database stops answering the census: the gauges stay, and their age says how old they are.
        real, failed = census.status_counts, []

        async def unavailable(pool):
            failed.append(1)
            raise db.DatabaseUnavailable("injected: the census's read fails")

        monkeypatch.setattr(census, "status_counts", unavailable)
        await pool.execute("INSERT INTO gpuq.jobs (kind) SELECT 'counted' FROM generate_series(1, 2)")
        await wait_for(lambda: len(failed) >= 1)  # no read succeeds from here on
        then = await scrape()
        await wait_for(lambda: len(failed) >= 3)
        now = await scrape()
        assert (now["pending"], then["pending"]) == (4, 4) and now["age"] > then["age"]
        monkeypatch.setattr(census, "status_counts", real)
        await wait_for(lambda: pending_is(6))
