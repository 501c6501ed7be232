"""`gpuq dev`'s demo in-process against the test database: its agents, its producer's mix, and what
the dashboard's agents page shows in its first seconds (issue #34 item 4)."""

from gpuq import admin, demomix
from gpuq.harness import running_server
from tests.helpers import agents_connected, wait_for
from tests.integration.test_ui import READ, UI, login, request


async def start_demo_agents(srv, n: int = 3) -> None:
    for i in range(n):
        await srv.agent(**demomix.agent_kwargs(i, 2))


async def test_the_demo_agents_report_their_devices_labels_models_and_batches(dsn):
    async with running_server(dsn) as srv:
        await start_demo_agents(srv)
        agents = {a["agent"].split("#")[0]: a for a in await agents_connected(srv)}
    assert set(agents) == {"h100-box-0", "a10-box-1", "h100-box-2"}
    h100, a10 = agents["h100-box-0"], agents["a10-box-1"]
    assert [(d["name"], d["memory_mb"]) for d in h100["devices"]] == [("sim-h100", 81920)] * 2
    assert [(d["name"], d["memory_mb"]) for d in a10["devices"]] == [("sim-a10", 24576)]
    assert "gpu=h100" in h100["labels"] and h100["models"] == ["llama-8b"]
    assert "gpu=a10" in a10["labels"] and a10["models"] == ["whisper-small"]
    assert agents["h100-box-2"]["models"] == ["sdxl"]
    assert all(a["kinds"] == sorted(demomix.KINDS) and a["batch"] == demomix.BATCH_ITEMS for a in agents.values())


async def test_the_producer_enqueues_placed_multi_gpu_long_and_batched_jobs(pool):
    await demomix.setup(pool)
    producer = demomix.Producer(pool, demomix.Mix(10, 0.05, demomix.fleet(3)))
    for t in range(31):  # half a minute of ticks, one a second
        await producer.step(float(t))
    rows = await pool.fetch("SELECT kind, gpus, gpu_memory_mb, labels, model, payload::jsonb AS payload, "
                            "max_attempts FROM gpuq.jobs")
    assert producer.enqueued == len(rows)
    assert any(r["gpus"] == 1 and r["model"] for r in rows)  # placed, with a model
    assert any(r["gpus"] == 1 and r["gpu_memory_mb"] for r in rows)
    assert any(r["gpus"] == 1 and "gpu=a10" in r["labels"] for r in rows)
    assert any(r["gpus"] == 2 for r in rows)  # multi-GPU
    assert any(r["kind"] == "train" and "steps" in r["payload"] for r in rows)  # long, with progress
    assert sum(r["kind"] == "embed" for r in rows) >= 2 * demomix.BATCH_ITEMS  # batched
    assert any(r["max_attempts"] == 2 and "fail" in r["payload"] for r in rows)  # ends dead
    [policy] = await admin.batching(pool)
    assert (policy["kind"], policy["max_items"]) == ("embed", demomix.BATCH_ITEMS)


async def test_the_agents_page_shows_devices_models_placed_jobs_and_progress_within_seconds(dsn, pool):
    await demomix.setup(pool)
    producer = demomix.Producer(pool, demomix.Mix(10, 0.05, demomix.fleet(3)))
    async with running_server(dsn, drain_seconds=0.1, **UI) as srv:  # leaves the long jobs running
        await start_demo_agents(srv)
        srv.tg.start_soon(producer.run, srv.stop)
        cookie = {"Cookie": await login(srv.port, READ)}
        page: list[str] = []

        async def shows_the_gpu_story() -> bool:
            page[:] = [(await request(srv.port, "GET", "/ui/agents", cookie))[2]]
            return "runs <a" in page[0] and "<progress" in page[0]

        await wait_for(shows_the_gpu_story, timeout=10, interval=0.2)
    body = page[0]
    assert "sim-h100" in body and "sim-a10" in body and "llama-8b" in body and "gpu=a10" in body
    assert "% step " in body  # a long job's bar, its percentage and message
