"""Fair share, first part (issue #32): tenants on jobs, weights, usage charged in GPU-seconds and shown.

Run times are set in SQL (``started_at`` in the past): in the ``conn`` fixture's transaction
``now()`` stands still, so a job started 10 s before it is charged exactly 10 s.
"""

import json

import anyio
import asyncpg
import pytest
import structlog
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from gpuq import admin, census, metrics, plans, producer, queue
from gpuq.dispatcher import Tuning
from gpuq.dispatcher.completer import Completer
from gpuq.harness import TOKEN, http_get, running_server
from gpuq.jobs import JobBackoff, NewJob
from gpuq.protocol import Done, Failed
from gpuq.sql import queries
from tests.helpers import add_pending, dispatcher_idle, wait_for

HALF_LIFE = 60.0


async def _running(db, tenant: str | None, seconds: float, gpus: int = 0, batch_size: int | None = None,
                   agent: str = "a#1", expired: bool = False) -> tuple[int, str]:
    """A job leased to ``agent`` that started ``seconds`` ago: (id, lease token)."""
    row = await db.fetchrow(
        "INSERT INTO gpuq.jobs (kind, tenant, gpus, status, attempts, lease_token, leased_by, lease_expires_at, "
        "started_at, batch_size) "
        "VALUES ('train', $1, $2, 'leased', 1, gen_random_uuid(), $5, now() + CASE WHEN $6 THEN interval '-4 s' "
        "ELSE interval '1 min' END, now() - make_interval(secs => $3), $4) "
        "RETURNING id, lease_token::text AS token", tenant, gpus, seconds, batch_size, agent, expired)
    return row["id"], row["token"]


async def _usage(db) -> dict[str, float]:
    return {r["tenant"]: round(r["usage"], 6) for r in await db.fetch("SELECT tenant, usage FROM gpuq.tenant_usage")}


async def _fair_share_on(db, **weights: float) -> None:
    for name, weight in (weights or {"acme": 1.0}).items():
        await admin.set_tenant(db, name, weight)
    await admin.set_half_life(db, HALF_LIFE)


# -- the schema ------------------------------------------------------------------


REFUSED = (
    "INSERT INTO gpuq.jobs (kind, tenant) VALUES ('k', 'a tenant')",  # the kind's rule
    "INSERT INTO gpuq.jobs (kind, tenant) VALUES ('k', '')",
    "INSERT INTO gpuq.jobs (kind, tenant) VALUES ('k', repeat('t', 129))",
    "INSERT INTO gpuq.tenants (name, weight) VALUES ('a,b', 1)",
    "INSERT INTO gpuq.tenants (name, weight) VALUES ('acme', 0)",
    "INSERT INTO gpuq.tenants (name, weight) VALUES ('acme', -1)",
    "INSERT INTO gpuq.tenants (name, weight) VALUES ('acme', 1000001)",
    "INSERT INTO gpuq.tenants (name, weight) VALUES ('acme', 'NaN')",
    "INSERT INTO gpuq.fair_share_settings (half_life_seconds) VALUES (0)",
    "INSERT INTO gpuq.fair_share_settings (id) VALUES (false)",  # one row only
)


async def test_sql_refuses_bad_tenants_weights_and_half_lives(conn):
    for statement in REFUSED:
        with pytest.raises(asyncpg.CheckViolationError):
            async with conn.transaction():  # a savepoint: the next statement goes on
                await conn.execute(statement)


async def test_sql_takes_a_tenant_and_the_default_tenant_may_have_a_weight(conn):
    job_id = await conn.fetchval("INSERT INTO gpuq.jobs (kind, tenant) VALUES ('k', 'team-a/prod') RETURNING id")
    await conn.execute("INSERT INTO gpuq.tenants (name, weight) VALUES ('default', 0.5), ('team-a/prod', 1000000)")
    assert (await admin.show(conn, job_id))["tenant"] == "team-a/prod"
    plain = await conn.fetchval("INSERT INTO gpuq.jobs (kind) VALUES ('k') RETURNING id")
    assert (await admin.show(conn, plain))["tenant"] == "default"
    assert await admin.half_life(conn) == 3600  # the default (this fixture emptied the settings row)


# -- producing -------------------------------------------------------------------


async def test_jobs_carry_a_tenant_from_python_and_default_is_no_tenant(conn):
    one = await producer.enqueue(conn, "k", tenant="acme")
    keyed = await producer.enqueue(conn, "k", tenant="beta", dedup_key="d1")
    mixed = await queue.enqueue_many(conn, [NewJob("k"), NewJob("k", tenant="acme"), NewJob("k", tenant="default")])
    stored = dict(await conn.fetch("SELECT id, tenant FROM gpuq.jobs"))
    assert [stored[i] for i in (one, keyed, *mixed)] == ["acme", "beta", None, "acme", None]
    assert (await admin.show(conn, mixed[2]))["tenant"] == "default"
    with pytest.raises(ValueError, match="bad tenant 'a b'"):
        await producer.enqueue(conn, "k", tenant="a b")
    with pytest.raises(ValueError, match="tenant must be a string"):
        NewJob.from_mapping({"kind": "k", "tenant": 7})


@pytest.fixture
def logging_kept():
    """The CLI's admin events point structlog at the captured stderr: put it back afterwards."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_gpuq_enqueue_and_gpuq_tenant_in_process(dsn, capsys, logging_kept):
    from gpuq.cli import main

    def gpuq(*argv: str) -> tuple[int, str, str]:
        code = main([*argv, "--database-url", dsn])
        out = capsys.readouterr()
        return code, out.out, out.err

    code, out, _ = gpuq("enqueue", "train", "--tenant", "acme")
    assert code == 0 and out.strip().isdigit()
    assert gpuq("tenant") == (0, "usage half-life: 3600 s\n"
                                 "fair share off: no tenant has a weight (gpuq tenant set NAME --weight W)\n", "")
    code, out, err = gpuq("tenant", "set", "acme", "--weight", "3")
    assert (code, out) == (0, "acme: weight 3\n") and '"event": "admin.tenant"' in err
    assert gpuq("tenant", "--half-life", "600")[0] == 0
    code, out, _ = gpuq("tenant")
    assert out.splitlines()[0] == "usage half-life: 600 s"
    assert out.splitlines()[1].split() == ["tenant", "weight", "usage", "(GPU-s)", "share", "fair", "share",
                                           "running", "pending"]
    assert out.splitlines()[2].split() == ["acme", "3", "0.0", "0.0%", "100.0%", "0", "1"]
    assert gpuq("tenant", "set", "acme", "none")[:2] == (0, "acme: weight removed (weighs 1)\n")
    for argv, says in ((["tenant", "set", "acme", "--weight", "0"], "a weight must be more than 0"),
                       (["tenant", "set", "a b", "--weight", "2"], "bad tenant 'a b'"),
                       (["tenant", "--half-life", "0.5"], "the half-life must be 1-"),
                       (["tenant", "set", "acme"], "gpuq tenant set NAME --weight W"),
                       (["tenant", "set", "acme", "none", "--weight", "2"], "gpuq tenant set NAME --weight W"),
                       (["tenant", "--weight", "2"], "gpuq tenant set NAME --weight W"),
                       (["enqueue", "train", "--tenant", "a,b"], "bad tenant 'a,b'")):
        code, _, err = gpuq(*argv)
        assert code == 1 and says in err, (argv, err)
    assert gpuq("tenant")[1].endswith("fair share off: no tenant has a weight (gpuq tenant set NAME --weight W)\n")


# -- weights ---------------------------------------------------------------------


async def test_weights_are_set_replaced_and_removed_and_each_change_wakes_the_dispatchers(pool, notifications):
    await admin.set_tenant(pool, "acme", 3)
    await admin.set_tenant(pool, "default", 0.25)
    await admin.set_tenant(pool, "acme", 2)
    assert await admin.tenant_weights(pool) == {"acme": 2.0, "default": 0.25}
    await admin.set_tenant(pool, "acme", None)
    await admin.set_tenant(pool, "nobody", None)  # no weight: nothing to remove
    assert await admin.tenant_weights(pool) == {"default": 0.25}
    assert [await notifications.next() for _ in range(5)] == ["*"] * 5
    for bad in (0, -1, 1_000_001, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="a weight must be more than 0"):
            await admin.set_tenant(pool, "acme", bad)
    with pytest.raises(ValueError, match="bad tenant"):
        await admin.set_tenant(pool, "", 1)
    await admin.set_half_life(pool, 7200)
    assert await admin.half_life(pool) == 7200
    with pytest.raises(ValueError, match="the half-life must be"):
        await admin.set_half_life(pool, 0)


# -- charging --------------------------------------------------------------------


async def test_an_attempt_charges_run_time_times_gpus_to_its_tenant(conn):
    await _fair_share_on(conn)
    two_gpus = await _running(conn, "acme", 10, gpus=2)
    cpu = await _running(conn, "acme", 5)
    plain = await _running(conn, None, 3)
    batched = await _running(conn, "beta", 8, batch_size=4)  # one slot for the batch: a quarter each
    retried = await _running(conn, "beta", 6, gpus=1)
    accepted = await queue.complete_many(conn, [(i, t, None) for i, t in (two_gpus, cpu, plain, batched)],
                                         charge=True)
    assert len(accepted) == 4
    assert await _usage(conn) == {"acme": 25.0, "default": 3.0, "beta": 2.0}
    assert (await queue.fail_many(conn, [(*retried, "oom", True)], charge=True))[retried[0]].status == "scheduled"
    assert await _usage(conn) == {"acme": 25.0, "default": 3.0, "beta": 8.0}
    # A stale outcome changes nothing and charges nothing.
    assert await queue.complete_many(conn, [(*two_gpus, None)], charge=True) == set()
    assert await _usage(conn) == {"acme": 25.0, "default": 3.0, "beta": 8.0}


async def test_usage_decays_with_the_half_life(conn):
    await _fair_share_on(conn)
    await conn.execute("INSERT INTO gpuq.tenant_usage (tenant, usage, usage_at) VALUES "
                       "('acme', 100, now() - interval '60 s'), ('beta', 100, now() - interval '120 s'), "
                       "('gone', 5, now() - interval '3601 s'), ('soon', 8, now() + interval '5 s')")
    job = await _running(conn, "acme", 10)
    await queue.complete_many(conn, [(*job, None)], charge=True)
    assert await _usage(conn) == {"acme": 60.0, "beta": 100.0, "gone": 5.0, "soon": 8.0}  # 100 / 2 + 10
    assert await conn.fetchval("SELECT usage_at = now() FROM gpuq.tenant_usage WHERE tenant = 'acme'")
    listed = {t.name: t.usage for t in await admin.tenants(conn)}
    assert listed == {"acme": 60.0, "beta": 25.0, "soon": 8.0}  # 60 half-lives on: 0, and not listed
    # A usage_at ahead of this transaction's clock (another one committed later) is not decayed backwards.
    job = await _running(conn, "soon", 1)
    await queue.complete_many(conn, [(*job, None)], charge=True)
    assert (await _usage(conn))["soon"] == 9.0


class _Agent:
    id = "a#1"

    def __init__(self) -> None:
        self.acks: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    def send_ack(self, accepted, rejected) -> None:
        self.acks.append((accepted, rejected))


class _Spy:
    """A pool that notes each statement the completer runs."""

    def __init__(self, pool) -> None:
        self.pool, self.ran = pool, []

    async def fetch(self, statement, *args, **kwargs):
        self.ran.append(next(name for name, text in queries.items() if text == statement))
        return await self.pool.fetch(statement, *args, **kwargs)


async def test_the_completer_charges_only_while_fair_share_is_on_with_the_plain_statements_off(pool):
    spy, on = _Spy(pool), [False]
    completer = Completer(spy, JobBackoff(), charging=lambda: on[0])
    agent = _Agent()
    await admin.set_tenant(pool, "acme", 2)  # in the table: the completer goes by what it was told
    for charging in (False, True):
        on[0] = charging
        (done, token), (failed, failed_token) = await _running(pool, "acme", 10), await _running(pool, "acme", 10)
        completer.submit(agent, [(Done(done, token, None), "train"), (Failed(failed, failed_token, "x", True), "train")])
        await completer.flush()
        assert agent.acks[-1] == ((done, failed), ())
        if not charging:
            assert spy.ran == ["complete_many", "fail_many"] and await _usage(pool) == {}
    assert spy.ran[2:] == ["complete_many_charged", "fail_many_charged"]
    assert 20 <= (await _usage(pool))["acme"] < 21  # two attempts of 10 s


async def test_the_completer_charges_the_run_time_the_agent_told_not_the_lease_s_age(pool):
    """Both jobs were leased 10 s ago; the protocol measured 2 and 3 s of run (a prefetched job's
    wait in its agent is not run time). A job without a measured run is charged its lease's age."""
    completer = Completer(pool, JobBackoff(), charging=lambda: True)
    agent = _Agent()
    await admin.set_tenant(pool, "acme", 1)
    (done, token), (failed, failed_token) = await _running(pool, "acme", 10), await _running(pool, "acme", 10)
    (other, other_token) = await _running(pool, "beta", 10)
    completer.submit(agent, [(Done(done, token, None), "train"), (Failed(failed, failed_token, "x", True), "train"),
                             (Done(other, other_token, None), "train")], {done: 2.0, failed: 3.0})
    await completer.flush()
    usage = await _usage(pool)
    assert 4.99 <= usage["acme"] <= 5 and 9.99 <= usage["beta"] < 11  # decayed a little since
    assert completer.ran == {}  # forgotten once written


async def test_a_refused_outcome_s_run_time_is_forgotten_too(pool):
    """PostgreSQL refuses a result with U+0000 (the completer then writes one by one and refuses
    that one): its run time goes with it, not kept for the server's life."""
    completer = Completer(pool, JobBackoff(), charging=lambda: True)
    agent = _Agent()
    await admin.set_tenant(pool, "acme", 1)
    bad, token = await _running(pool, "acme", 10)
    completer.submit(agent, [(Done(bad, token, {"text": "nul\u0000"}), "train")], {bad: 2.0})
    await completer.flush()
    assert agent.acks[-1] == ((), (bad,)) and completer.ran == {}


async def test_the_sweeper_and_a_disconnect_charge_only_while_fair_share_is_on(conn):
    for on in (False, True):
        await conn.execute("DELETE FROM gpuq.jobs")
        if on:
            await _fair_share_on(conn)
        await _running(conn, "lost", 30, gpus=2, expired=True)  # the lease expired 4 s ago: charged 26 s
        await _running(conn, "slow", 100)
        await conn.execute("UPDATE gpuq.jobs SET deadline_at = now() - interval '1 h' WHERE tenant = 'slow'")
        started, _ = await _running(conn, "left", 7, agent="b#1")
        await _running(conn, "left", 9, agent="b#1")  # prefetched, never started: no charge
        assert len((await queue.reclaim_expired(conn)).pending) == 1
        assert len((await queue.expire_deadlines(conn, 10, 30.0)).pending) == 1
        assert len((await queue.release_agent(conn, "b#1", [started])).pending) == 2
        assert await _usage(conn) == ({"lost": 52.0, "slow": 100.0, "left": 7.0} if on else {})


async def test_running_jobs_count_provisionally_and_each_tenant_shows_its_backlog(conn, monkeypatch):
    assert await admin.tenants(conn) == []  # fair share off: nothing read
    await _fair_share_on(conn, acme=3, beta=1, idle=5)
    await conn.execute("INSERT INTO gpuq.tenant_usage (tenant, usage, usage_at) VALUES ('acme', 40, now())")
    await _running(conn, "acme", 10, gpus=2)
    await _running(conn, None, 20)
    await queue.enqueue_many(conn, [NewJob("k", tenant="beta")] * 3 + [NewJob("k", gpus=1, tenant="beta"),
                                                                     NewJob("k", gpus=1), NewJob("k", tenant="acme")])
    await add_pending(conn, 2)  # no tenant
    await conn.execute("INSERT INTO gpuq.jobs (kind, tenant) VALUES ('k', 'default')")  # named as the default
    got = {t.name: t for t in await admin.tenants(conn)}
    assert list(got) == ["acme", "beta", "default", "idle"]
    acme, beta, default, idle = got.values()
    assert (acme.usage, acme.running, acme.pending, acme.weight, acme.weighted) == (60.0, 1, 1, 3.0, True)
    assert (default.usage, default.running, default.pending, default.weight, default.weighted) == (20.0, 1, 4, 1.0, False)
    assert (beta.usage, beta.running, beta.pending) == (0.0, 0, 4)
    assert (idle.usage, idle.pending, idle.share, idle.fair_share) == (0.0, 0, 0.0, 0.0)
    assert (acme.share, default.share, beta.share) == (0.75, 0.25, 0.0)
    assert (acme.fair_share, beta.fair_share, default.fair_share) == (0.6, 0.2, 0.2)  # idle's weight left out
    monkeypatch.setattr(admin, "COUNT_CAP", 3)
    assert {t.name: t.pending for t in await admin.tenants(conn)} == {"acme": 1, "beta": 3, "default": 3, "idle": 0}


async def test_the_tenants_read_and_the_charged_outcomes_read_no_history(conn):
    """100,000 done rows of tenants: the read is index probes per tenant with work, and the
    running jobs; the charged outcomes find their rows by primary key."""
    await conn.execute("INSERT INTO gpuq.jobs (kind, status, attempts, finished_at, tenant) "
                       "SELECT 'train', 'done', 1, now(), 't' || (g % 50) FROM generate_series(1, 100000) g")
    await _fair_share_on(conn, **{f"t{i}": 1.0 for i in range(50)})
    await conn.execute("INSERT INTO gpuq.tenant_usage (tenant, usage) SELECT 't' || g, g FROM generate_series(0, 49) g")
    await queue.enqueue_many(conn, [NewJob("k", tenant=f"t{i % 5}") for i in range(50)] + [NewJob("k")] * 5)
    jobs = [await _running(conn, f"t{i}", 10) for i in range(10)]
    await conn.execute("ANALYZE gpuq.jobs")
    plan = await plans.explain(conn, queries["tenant_usage"], 1000)
    # gpuq.tenant_usage is read whole: a row per tenant charged, never a job's; gpuq.shapes: a row a shape.
    used = plans.plan_indexes(plan)
    assert used <= {"jobs_fair_placed_idx", "jobs_fair_idx", "jobs_leased_idx", "tenants_pkey", "tenant_usage_pkey",
                    "seqscan:tenant_usage", "shapes_pkey", "seqscan:shapes", "jobs_placed_idx"}, used
    assert plans.plan_buffers(plan) < 150, plans.plan_buffers(plan)  # 43 measured
    ids, tokens = [i for i, _ in jobs], [t for _, t in jobs]
    b = JobBackoff()
    for name, args in (("complete_many_charged", (ids, tokens, [None] * 10, [1.0] * 10)),
                       ("fail_many_charged", (ids, tokens, ["x"] * 10, [True] * 10, b.base_seconds, b.cap_seconds,
                                              b.jitter, [None] * 10))):
        plan = await plans.explain(conn, queries[name], *args)
        indexes = plans.plan_indexes(plan)
        assert "jobs_leased_idx" not in indexes and "jobs_pkey" in indexes, (name, indexes)
        assert not [i for i in indexes if i.startswith("seqscan")], (name, indexes)
        assert plans.plan_buffers(plan) < 300, (name, plans.plan_buffers(plan))


# -- a server: its completer, /status, /metrics ----------------------------------


def _tenant_series(text: str) -> dict[tuple[str, str], float]:
    return {(s.name, s.labels["tenant"]): s.value for f in text_string_to_metric_families(text)
            if f.name.startswith("gpuq_tenant_") for s in f.samples}


async def _ran_a_while(job) -> None:
    await anyio.sleep(0.05)  # charged its run time: from the agent's started to its outcome


async def test_a_server_charges_its_agents_jobs_once_a_weight_is_set_and_shows_each_tenant(dsn, pool, monkeypatch):
    monkeypatch.setattr(census, "LOAD_SHARE", 1.0)  # a read every 0.05 s, however slow this machine's reads are
    async with running_server(dsn, tuning=Tuning(fair_share_seconds=0), metrics_sample_seconds=0.05) as srv:
        await srv.agent(["train"], 2, _ran_a_while)
        await producer.wait(pool, await producer.enqueue(pool, "train", tenant="acme"), timeout=10)
        assert await _usage(pool) == {}  # fair share off: nothing charged, nothing shown
        assert json.loads((await http_get(srv.http + "/status", token=TOKEN))[2])["tenants"] == []
        assert _tenant_series((await http_get(srv.http + "/metrics"))[2]) == {}

        await admin.set_tenant(pool, "acme", 3)  # on: the '*' it sends has the dispatcher read the weights
        await dispatcher_idle()
        await producer.wait(pool, await producer.enqueue(pool, "train", tenant="acme"), timeout=10)
        used = (await _usage(pool))["acme"]
        assert used > 0 and list(await _usage(pool)) == ["acme"]
        await pool.execute("INSERT INTO gpuq.jobs (kind, tenant) VALUES ('other', 'beta')")  # no agent takes it
        tenants = json.loads((await http_get(srv.http + "/status", token=TOKEN))[2])["tenants"]
        assert [(t["tenant"], t["weight"], t["weighted"], t["share"], t["fair_share"], t["pending"])
                for t in tenants] == [("acme", 3, True, 1.0, 0.75, 0), ("beta", 1, False, 0.0, 0.25, 1)]
        assert 0 < tenants[0]["usage_gpu_seconds"] <= round(used, 3)
        series: dict[tuple[str, str], float] = {}

        async def beta_is_counted() -> bool:  # the census's next read (gpuq.census): the scrape reads no database
            series.update(_tenant_series((await http_get(srv.http + "/metrics"))[2]))
            return series.get(("gpuq_tenant_backlog", "beta")) == 1.0

        await wait_for(beta_is_counted)
        assert 0 < series[("gpuq_tenant_usage_gpu_seconds", "acme")] <= used + 1e-6  # used: rounded to 6 places
        assert {k: v for k, v in series.items() if k[0] != "gpuq_tenant_usage_gpu_seconds"} == {
            ("gpuq_tenant_share", "acme"): 1.0, ("gpuq_tenant_share", "beta"): 0.0,
            ("gpuq_tenant_fair_share", "acme"): 0.75, ("gpuq_tenant_fair_share", "beta"): 0.25,
            ("gpuq_tenant_weight", "acme"): 3.0, ("gpuq_tenant_weight", "beta"): 1.0,
            ("gpuq_tenant_backlog", "acme"): 0.0, ("gpuq_tenant_backlog", "beta"): 1.0}


async def test_the_census_reads_the_tenants_only_while_fair_share_is_on(pool, monkeypatch):
    """Off, a census read costs no tenant statement and shows no tenant series; on, it reads them
    and /metrics serves what it read; off again, the series go."""
    reads = []

    async def counted(db):
        reads.append(1)
        return await admin.tenants(db)

    monkeypatch.setattr(census, "tenants", counted)
    await admin.set_tenant(pool, "acme", 2)
    await pool.execute("INSERT INTO gpuq.jobs (kind, tenant) VALUES ('train', 'acme')")
    on = [False]
    reader = census.Census(pool, period=5.0, fair_share=lambda: on[0])

    def shown() -> dict[tuple[str, str], float]:
        return _tenant_series(generate_latest(metrics.REGISTRY).decode())

    assert (await reader.read()).tenants == [] and reads == [] and shown() == {}
    on[0] = True
    assert [t.name for t in (await reader.read()).tenants] == ["acme"] and reads == [1]
    assert (shown()[("gpuq_tenant_weight", "acme")], shown()[("gpuq_tenant_backlog", "acme")]) == (2.0, 1.0)
    on[0] = False
    await reader.read()
    assert reads == [1] and shown() == {}
