"""examples/: the GPU agent loads its model on each device and runs one job per device."""

import json
from pathlib import Path

import anyio
import pytest

from gpuq.harness import TOKEN, http_get, running_server, spawn
from tests.helpers import wait_for

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "gpu_agent.py"


async def test_the_gpu_agent_example_runs_one_job_per_device_on_its_warm_model(dsn, live_conn, tmp_path):
    async with running_server(dsn, poll_seconds=60) as srv:
        agent = spawn("gpu-agent", [str(EXAMPLE), srv.url, "--token", TOKEN, "--devices", "sim:1G,sim:1G",
                                    "--name", "example"], tmp_path)
        try:
            async def ready() -> bool:
                assert agent.alive(), agent.tail()
                body = json.loads((await http_get(f"{srv.http}/status", token=TOKEN))[2])
                return [a["models"] for a in body["agents"]] == [["tiny-linear"]]

            await wait_for(ready, timeout=30)
            ids = [r[0] for r in await live_conn.fetch(
                "INSERT INTO gpuq.jobs (kind, payload, gpus, model) SELECT 'embed', "
                "jsonb_build_object('inputs', jsonb_build_array(jsonb_build_array(g, 2, 3, 4))), 1, 'tiny-linear' "
                "FROM generate_series(1, 4) g RETURNING id")]
            bad = await live_conn.fetchval(
                """INSERT INTO gpuq.jobs (kind, payload, gpus) VALUES ('embed', '{"inputs": [[1]]}', 1) RETURNING id""")

            async def ended() -> bool:
                return await live_conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status IN ('done', 'dead')") == 5

            await wait_for(ended, timeout=30)
        finally:
            await anyio.to_thread.run_sync(agent.stop)  # the server answers its goodbye meanwhile
    rows = {r["id"]: r for r in await live_conn.fetch("SELECT id, status::text, result, last_error FROM gpuq.jobs")}
    results = [rows[i]["result"] for i in ids]
    assert [r["outputs"] for r in results] == [[[pytest.approx(g - 0.9), pytest.approx(0.25 * g + 7.15)]]
                                                for g in range(1, 5)]
    assert {r["device"] for r in results} == {0, 1}  # the first two started at once, one per device
    assert {r["backend"] for r in results} <= {"torch", "numpy", "python"}
    assert rows[bad]["status"] == "dead" and "inputs" in rows[bad]["last_error"]
