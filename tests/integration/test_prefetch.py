"""Prefetch (issue #17, protocol 5): jobs held ready beyond capacity, given back unstarted at once."""

import json

import anyio

from gpuq import admin
from gpuq.harness import TOKEN, http_get, next_of, raw_agent, running_server
from tests.helpers import wait_count, wait_for

HELLO_5 = {"protocol": 5, "devices": [], "labels": [], "models": []}


async def _jobs(pool, n: int) -> list[int]:
    return [r[0] for r in await pool.fetch(
        "INSERT INTO gpuq.jobs (kind) SELECT 'embed' FROM generate_series(1, $1) RETURNING id", n)]


async def _attempts(pool, ids: list[int]) -> list[tuple[str, int]]:
    rows = await pool.fetch("SELECT id, status::text, attempts FROM gpuq.jobs WHERE id = ANY($1) ORDER BY id", ids)
    return [(r["status"], r["attempts"]) for r in rows]


async def test_a_prefetched_job_goes_back_at_once_when_its_agent_disconnects_its_attempt_not_counted(dsn, pool):
    async with running_server(dsn, lease_seconds=300) as srv:
        first, second = await _jobs(pool, 2)
        ws, _ = await raw_agent(srv, capacity=1, prefetch=1, **HELLO_5)
        pushed: list[int] = []
        while len(pushed) < 2:
            pushed += [j["id"] for j in (await next_of(ws, "jobs"))["jobs"]]
        assert pushed == [first, second]  # one running, one held ready
        await ws.send(json.dumps({"type": "started", "ids": [first]}))
        await ws.close()
        await wait_count(pool, "pending", 2, timeout=5)  # far sooner than the 300 s lease
    assert await _attempts(pool, [first, second]) == [("pending", 1), ("pending", 0)]


def _blocking(ran: list[int], release: anyio.Event):
    async def handler(job):
        ran.append(job.id)
        await release.wait()
    return handler


async def test_a_draining_agent_gives_back_its_ready_job_at_once(dsn, pool):
    ran: list[int] = []
    release = anyio.Event()
    async with running_server(dsn, lease_seconds=300) as srv:
        first, second = await _jobs(pool, 2)
        agent = await srv.agent(["embed"], 1, _blocking(ran, release), "a", prefetch=1)
        await wait_for(lambda: _holds(srv, 2))
        agent.stop()
        await wait_count(pool, "pending", 1)  # while the first still runs
        assert await _attempts(pool, [second]) == [("pending", 0)]
        release.set()
        await wait_count(pool, "done", 1)
    assert ran == [first]


async def test_a_cancelled_prefetched_job_never_starts(dsn, pool):
    ran: list[int] = []
    release = anyio.Event()
    # Heartbeats every 60 s: the agent must send its report of the job it ended unstarted at once,
    # not with its next frame (while its running job holds on, that was the next heartbeat).
    async with running_server(dsn, lease_seconds=300, heartbeat_seconds=60) as srv:
        first, second = await _jobs(pool, 2)
        await srv.agent(["embed"], 1, _blocking(ran, release), "a", prefetch=1)
        await wait_for(lambda: _holds(srv, 2))
        assert await admin.cancel(pool, second) == {second: "leased"}
        await wait_for(lambda: _holds(srv, 1))  # the agent reported it, without running it
        release.set()
        await wait_count(pool, "done", 1)
    assert ran == [first]
    assert (await _attempts(pool, [second]))[0][0] == "cancelled"



async def _holds(srv, n: int) -> bool:
    """The agent holds n jobs (pushed, not reported), and the first of them runs."""
    [agent] = json.loads((await http_get(f"{srv.http}/status", token=TOKEN))[2])["agents"]
    return agent["inflight"] == n and agent["inflight"] - agent["unstarted"] == 1


async def test_after_a_running_job_is_cancelled_its_slot_runs_the_ready_one_with_its_own_timeout(dsn, pool):
    ran: list[int] = []

    async def hang(job):
        ran.append(job.id)
        await anyio.sleep(60)  # not a settle wait: the job hangs until cancelled or timed out

    async with running_server(dsn, lease_seconds=300) as srv:
        cancelled, timed = [r[0] for r in await pool.fetch(
            "INSERT INTO gpuq.jobs (kind, timeout_seconds, max_attempts) VALUES ('embed', NULL, 1), ('embed', 1, 1) "
            "RETURNING id")]
        await srv.agent(["embed"], 1, hang, "a", prefetch=1)
        await wait_for(lambda: _holds(srv, 2))
        await admin.cancel(pool, cancelled)
        await wait_count(pool, "dead", 1)  # the next job ran in the same slot and hit its own timeout
    assert ran == [cancelled, timed]
    rows = await pool.fetch("SELECT status::text, last_error FROM gpuq.jobs ORDER BY id")
    assert [tuple(r) for r in rows] == [("cancelled", "cancelled"), ("dead", "timeout")]


# -- jobs ready on busy devices, the slots' busy fraction (protocol 6) ---------------

GPU_HELLO_6 = {"protocol": 6, "devices": [{"index": 0, "name": "h100", "memory_mb": 81920}], "labels": [],
               "models": [], "prefetch": 1}


async def test_a_job_ready_on_a_busy_device_goes_back_at_once_when_its_agent_disconnects(dsn, pool):
    async with running_server(dsn, lease_seconds=300) as srv:
        ids = [r[0] for r in await pool.fetch(
            "INSERT INTO gpuq.jobs (kind, gpus) SELECT 'train', 1 FROM generate_series(1, 3) RETURNING id")]
        ws, _ = await raw_agent(srv, kinds=("train",), capacity=1, **GPU_HELLO_6)
        pushed: list[dict] = []
        while len(pushed) < 2:
            pushed += (await next_of(ws, "jobs"))["jobs"]
        assert [(j["id"], j["devices"]) for j in pushed] == [(ids[0], [0]), (ids[1], [0])]  # one runs, one waits
        assert all(j["queued_ms"] >= 0 for j in pushed)
        await ws.send(json.dumps({"type": "started", "ids": [ids[0]]}))
        await ws.close()
        await wait_count(pool, "pending", 3, timeout=5)
    rows = await pool.fetch("SELECT id, attempts FROM gpuq.jobs WHERE id = ANY($1) ORDER BY id", ids)
    assert [r["attempts"] for r in rows] == [1, 0, 0]


def _sample(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


async def test_agents_report_busy_time_and_gaps_to_metrics_and_status(dsn, pool):
    async def work(job):
        await anyio.sleep(0.01)  # not a settle wait: busy time for the slot to report

    async with running_server(dsn, heartbeat_seconds=0.2) as srv:
        before = (await http_get(f"{srv.http}/metrics"))[2]
        await _jobs(pool, 30)
        await srv.agent(["embed"], 1, work, "a", prefetch=1)
        await wait_count(pool, "done", 30)

        async def reported() -> bool:
            text = (await http_get(f"{srv.http}/metrics"))[2]
            return _sample(text, "gpuq_slot_gap_seconds_count") - _sample(before, "gpuq_slot_gap_seconds_count") == 30

        await wait_for(reported)  # one gap per start, the first from the agent's connect
        text = (await http_get(f"{srv.http}/metrics"))[2]
        busy = _sample(text, "gpuq_slot_busy_seconds_total") - _sample(before, "gpuq_slot_busy_seconds_total")
        assert 0.3 <= busy < 3  # 30 handlers of 10 ms, each measured by the agent
        body = json.loads((await http_get(f"{srv.http}/status", token=TOKEN))[2])
        fraction = body["slots"]["busy_fraction"]
        assert 0 < fraction <= 1 and body["slots"]["busy_seconds"] >= 0.3
        assert body["agents"][0]["busy_fraction"] == fraction  # the only agent
