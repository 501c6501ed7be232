"""Wake-ups that do not serialize producers: the mark, the lease floors, the handshake.

docs/design.md ("Wake-ups") has the argument these tests check: inserts NOTIFY
only while a dispatcher waits (or above a lease floor), and a dispatcher that
goes idle while producers commit loses no wake-up, so no job waits for a poll.
"""

import asyncio
import random

import anyio
import asyncpg

from gpuq import db, metrics, wakeups
from gpuq.dispatcher import Tuning
from gpuq.harness import running_server
from tests.conftest import Notifications
from tests.helpers import wait_for

MARK_LAPSED = "SELECT last_value < (extract(epoch FROM clock_timestamp()) * 1000)::bigint FROM gpuq.wake_until"
INSERT_IF_LAPSED = """
WITH i AS (INSERT INTO gpuq.jobs (kind) SELECT 'slow' WHERE (
    SELECT last_value < (extract(epoch FROM clock_timestamp()) * 1000)::bigint FROM gpuq.wake_until)
    RETURNING 1)
SELECT count(*) FROM i"""


async def listening(dsn: str) -> tuple[asyncpg.Connection, Notifications]:
    """A LISTEN connection that has not armed the mark: it sees what producers send on their own."""
    n = Notifications()
    c = await db.connect(dsn)
    await c.add_listener(wakeups.NOTIFY_CHANNEL, n._on_notify)
    return c, n


async def test_inserts_do_not_notify_while_no_dispatcher_waits(dsn, live_conn):
    c, got = await listening(dsn)
    try:
        await live_conn.execute("INSERT INTO gpuq.jobs (kind) VALUES ('train')")
        assert await got.drain() == []
        await wakeups.arm_wakeups(live_conn, 60_000)
        await live_conn.execute("INSERT INTO gpuq.jobs (kind) VALUES ('train')")
        assert await got.drain() == ["+"]
        await live_conn.execute("INSERT INTO gpuq.jobs (kind, status, run_at) "
                                "VALUES ('train', 'scheduled', now() + interval '1h')")
        assert await got.drain() == ["+"]  # no pending job: a pass that finds nothing, harmless
    finally:
        await c.close()


async def test_the_mark_lapses_and_never_moves_back(dsn, live_conn):
    c, got = await listening(dsn)
    try:
        first = await wakeups.arm_wakeups(live_conn, 300)
        second = await wakeups.arm_wakeups(live_conn, 1)  # a shorter arm keeps the later mark
        assert second.until == first.until and second.previous == first.until
        await live_conn.execute("INSERT INTO gpuq.jobs (kind) VALUES ('a')")
        assert await got.drain(0.1) == ["+"]
        await wait_for(lambda: live_conn.fetchval(MARK_LAPSED), interval=0.05)
        await live_conn.execute("INSERT INTO gpuq.jobs (kind) VALUES ('a')")
        assert await got.drain() == []
    finally:
        await c.close()


async def test_an_insert_above_a_lease_floor_notifies_while_nobody_waits(dsn, live_conn):
    c, got = await listening(dsn)
    try:
        await wakeups.set_floors(live_conn, c.get_server_pid(), {"a": 0})
        await live_conn.execute("INSERT INTO gpuq.jobs (kind, priority) VALUES ('a', 0), ('b', 7)")
        assert await got.drain() == []  # ahead of the cursor, or no cursor in b
        await live_conn.execute("INSERT INTO gpuq.jobs (kind, priority) VALUES ('a', 3), ('b', 7)")
        assert await got.drain() == ["a@3"]  # behind a's cursor: the dispatcher must rewind
    finally:
        await c.close()


async def test_floors_of_gone_dispatchers_are_cleared(live_conn):
    me = live_conn.get_server_pid()
    await wakeups.set_floors(live_conn, 2_000_000_000, {"a": 0})  # no such backend
    await wakeups.set_floors(live_conn, me, {"a": 1, "b": -2})
    assert await live_conn.fetchval("SELECT count(*) FROM gpuq.lease_floors") == 3
    await wakeups.clear_floors(live_conn, 0)
    assert await live_conn.fetch("SELECT kind, priority FROM gpuq.lease_floors ORDER BY kind") == [
        ("a", 1), ("b", -2)]


async def test_the_writers_are_read_with_a_kept_plan_and_one_copy_of_the_lock_table(live_conn):
    """``jobs_writers`` runs up to every 10 ms while jobs arrive: as PL/pgSQL its plan is kept for the
    session (a SQL function's was made again at every call), and pg_locks, which copies the whole
    lock table at each read, is read once (migration 0024)."""
    lang, body = await live_conn.fetchrow(
        "SELECT l.lanname, p.prosrc FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang "
        "WHERE p.oid = 'gpuq.jobs_writers'::regproc")
    assert lang == "plpgsql"
    assert body.lower().count("pg_locks") == 1


async def test_arming_names_the_writers_of_jobs_still_open(dsn, live_conn):
    producer = await db.connect(dsn)
    try:
        tx = producer.transaction()
        await tx.start()
        await producer.execute("INSERT INTO gpuq.jobs (kind) VALUES ('train')")
        xid = await producer.fetchval("SELECT backend_xid::text FROM pg_stat_activity WHERE pid = pg_backend_pid()")
        armed = await wakeups.arm_wakeups(live_conn, 1000)
        assert xid in armed.stragglers
        assert xid in await wakeups.stragglers_left(live_conn, armed.stragglers)
        await tx.commit()
        assert await wakeups.stragglers_left(live_conn, armed.stragglers) == []
    finally:
        await producer.close()


def lapsed_arms() -> float:
    return metrics.REGISTRY.get_sample_value("gpuq_wakeup_arms_total", {"lapsed": "true"}) or 0.0


async def test_a_job_committed_as_the_dispatcher_goes_idle_needs_no_poll(dsn, pool):
    """The race itself: an insert reads a lapsed mark (no NOTIFY) while the
    dispatcher is busy, then commits only after the dispatcher has gone idle.
    The poll is a minute away, so only the handshake can deliver it in time."""
    delivered: dict[str, anyio.Event] = {"slow": anyio.Event()}

    async def handle(job):
        if job.kind == "slow":
            delivered["slow"].set()

    listener, got = await listening(dsn)
    stream_done = anyio.Event()

    async def stream() -> None:  # keeps the dispatcher busy, so it does not arm
        with anyio.move_on_after(10):
            while not stream_done.is_set():
                await pool.execute("INSERT INTO gpuq.jobs (kind) VALUES ('fast')")
                await anyio.sleep(0.002)  # not a settle wait: the stream's pace

    try:
        # Busy polls far apart enough that each finds some of the stream's jobs.
        async with running_server(dsn, poll_seconds=60, busy_poll_seconds=0.03,
                                  tuning=Tuning(wake_mark_ms=300)) as srv:  # lapses within the busy stream
            await srv.agent(["fast", "slow"], 64, handle)
            before = lapsed_arms()
            async with anyio.create_task_group() as tg:
                tg.start_soon(stream)
                slow = await pool.acquire()
                try:
                    with anyio.fail_after(10):  # insert only while the mark is lapsed before and after
                        while True:
                            tx = slow.transaction()
                            await tx.start()
                            if await slow.fetchval(INSERT_IF_LAPSED):
                                # An arm from here on comes after the insert: one before it moved
                                # the mark, and the check below fails.
                                armed_before = lapsed_arms()
                                if await slow.fetchval(MARK_LAPSED):
                                    break  # the mark only moves forward, by more than this took: no NOTIFY
                            await tx.rollback()
                            await anyio.sleep(0.01)  # not a settle wait: the retry's interval
                    await anyio.sleep(0.05)  # not a settle wait: the stream (busy polls) goes on past the insert
                    stream_done.set()  # the dispatcher finds no more work and goes idle (it may have already),
                    await wait_for(lambda: lapsed_arms() > armed_before)  # finds the mark lapsed: waits on stragglers
                    await tx.commit()
                finally:
                    await pool.release(slow)
            with anyio.fail_after(5):
                await delivered["slow"].wait()
            assert lapsed_arms() > before
        assert not any("slow" in p for p in await got.drain(0.1)), "the race was not exercised"
    finally:
        await listener.close()


async def test_producers_racing_an_idling_dispatcher_lose_no_wake_up(dsn, pool):
    """Many producers, bursts and gaps, transactions held open a little, a few
    priorities: every job arrives within seconds although the poll is a minute away."""
    seen: set[int] = set()
    all_seen = anyio.Event()
    total = 8 * 40

    async def handle(job):
        seen.add(job.id)
        if len(seen) == total:
            all_seen.set()

    async def producer(rng: random.Random) -> None:
        async with pool.acquire() as c:
            for _ in range(40):
                async with c.transaction():
                    await c.execute("INSERT INTO gpuq.jobs (kind, priority) VALUES ('work', $1)",
                                    rng.choice([0, 0, 0, 3, 7]))  # levels: floors move both ways
                    if rng.random() < 0.3:
                        await asyncio.sleep(rng.uniform(0, 0.03))  # commit late: a straggler
                await asyncio.sleep(rng.choice([0, 0.001, 0.005, 0.02, 0.06]))  # bursts and idle gaps

    async with running_server(dsn, poll_seconds=60, tuning=Tuning(wake_mark_ms=30)) as srv:
        await srv.agent(["work"], 32, handle)
        async with anyio.create_task_group() as tg:
            for seed in range(8):
                tg.start_soon(producer, random.Random(seed))
        with anyio.move_on_after(10):
            await all_seen.wait()
        missing = set(range(1, total + 1)) - seen
        rows = await pool.fetch("SELECT id, status FROM gpuq.jobs WHERE id = ANY($1::bigint[])", list(missing))
        assert not missing, (len(seen), rows)


async def test_a_lowered_floor_rewinds_at_once_and_as_each_insert_that_read_the_old_one_ends(dsn, pool, live_conn):
    """An insert that read the old floor did not notify and may commit behind
    the cursor: the kind starts from the top again at once, and again as soon
    as each transaction writing jobs when the floor moved ends."""
    from gpuq.config import ServerConfig
    from gpuq.dispatcher.groups import GroupLeases
    from gpuq.dispatcher.sessions import Sessions
    from gpuq.dispatcher.trigger import Pass

    g = GroupLeases(pool, ServerConfig(database_url=dsn, poll_seconds=60), Tuning(),
                    listen_pid=live_conn.get_server_pid, recheck=lambda kinds: None)
    c = g.cursors

    async def lease_to(**cursors):  # what a lease that moved the cursors there records
        await g._record_floors(c.leased(cursors, c.rewinds))

    async def a_pass():
        async for _jobs in g.lease(Sessions(), Pass(), listening=True, stopping=lambda: False):
            pass

    await lease_to(a=(5, 10), b=(0, 10))  # first floors: nobody writing, a rewind and nothing to wait for
    assert c.cursors == {} and c.confirm == []
    producer = await db.connect(dsn)
    try:
        tx = producer.transaction()
        await tx.start()
        await producer.execute("INSERT INTO gpuq.jobs (kind, priority) VALUES ('a', 3)")  # reads floor 5
        await lease_to(a=(0, 20), b=(0, 20))  # a: 5 -> 0, its job lands behind the cursor
        assert c.cursors == {"b": (0, 20)}
        c.cursors["a"] = (0, 30)  # the next lease moved it on while the producer's commit is pending
        await a_pass()
        assert c.cursors == {"a": (0, 30), "b": (0, 20)}  # nothing ended: nothing new behind it
        await tx.commit()
        await a_pass()
        assert c.cursors == {"b": (0, 20)} and c.confirm == []
        assert await live_conn.fetchval("SELECT priority FROM gpuq.lease_floors WHERE kind = 'a'") == 0
    finally:
        await producer.close()


async def test_the_lowest_floor_gates_the_trigger(dsn, live_conn):
    """The trigger looks floors up only for inserts above the lowest one of all."""
    c, got = await listening(dsn)
    try:
        lowest = "SELECT pg_sequence_last_value('gpuq.lowest_floor')"
        await wakeups.set_floors(live_conn, live_conn.get_server_pid(), {"a": 4, "b": 2})
        await wakeups.set_floors(live_conn, 2_000_000_000, {"a": 3})  # a dispatcher that is gone
        assert await live_conn.fetchval(lowest) == 2
        await live_conn.execute("INSERT INTO gpuq.jobs (kind, priority) VALUES ('a', 2), ('b', 2)")
        await live_conn.execute("INSERT INTO gpuq.jobs (kind, priority) VALUES ('a', 4), ('b', 3)")
        assert sorted(await got.drain()) == ["a@4", "b@3"]  # above 3 (a), 2 (b)
        await wakeups.clear_floors(live_conn, live_conn.get_server_pid())
        assert await live_conn.fetchval(lowest) == 32767  # no floors: nothing is above
        await live_conn.execute("INSERT INTO gpuq.jobs (kind, priority) VALUES ('a', 9)")
        assert await got.drain() == []
    finally:
        await c.close()


async def nested_plans(conn: asyncpg.Connection, statement: str) -> list[str]:
    """The plans of every statement ``statement`` runs, nested ones too (auto_explain, as notices)."""
    got: list[str] = []
    conn.add_log_listener(lambda _c, msg: got.append(msg.message))
    await conn.execute("LOAD 'auto_explain'; SET auto_explain.log_min_duration = 0;"
                       "SET auto_explain.log_nested_statements = on; SET auto_explain.log_level = notice")
    await conn.execute(statement)
    await conn.execute("RESET auto_explain.log_min_duration")
    return got


async def test_the_wake_up_path_never_plans_a_scan_the_guards_price_out(live_conn):
    """gpuq's sessions price sequential scans out (enable_seqscan = off), so a
    statement that has no other path costs 1e10 and would be JIT-compiled on
    every call: the trigger read its sequence that way once, and producers'
    commits fell to 77/s. Every statement an insert, an arm and a horizon run
    must have another path (sequences are read with pg_sequence_last_value)."""
    await wakeups.set_floors(live_conn, live_conn.get_server_pid(), {"train": 0})
    for statement in ("INSERT INTO gpuq.jobs (kind, priority) VALUES ('train', 1)",
                      "SELECT gpuq.arm_wakeups(1000)", "SELECT gpuq.insert_horizon()"):
        plans = await nested_plans(live_conn, statement)
        assert plans, statement
        assert not [p for p in plans if "Seq Scan" in p or "JIT" in p], (statement, plans)
    assert await live_conn.fetchval("SHOW jit") == "off"


async def test_the_mark_stays_armed_while_a_shapes_read_is_throttled(dsn, pool):
    """A notification asks for the shapes; the read is throttled, so the dispatcher
    waits for it. That wait must arm the mark like any other: a job inserted
    meanwhile notifies and is leased at once, not when the throttle ends."""
    arrived: dict[int, anyio.Event] = {}

    async def handle(job):
        arrived.setdefault(job.id, anyio.Event()).set()

    # The mark lapses long before the throttle ends.
    async with running_server(dsn, poll_seconds=60, tuning=Tuning(wake_mark_ms=30, shapes_seconds=30.0)) as srv:
        await srv.agent(["work"], 4, handle)
        for _ in range(3):  # the first read is free; each later one waits out the throttle
            job_id = await pool.fetchval("INSERT INTO gpuq.jobs (kind) VALUES ('work') RETURNING id")
            with anyio.fail_after(10):  # well before the throttle's 30 s or the poll's 60 s
                await arrived.setdefault(job_id, anyio.Event()).wait()
            # Not a settle wait: longer than the 30 ms mark, which only arming again keeps valid.
            await anyio.sleep(0.2)
