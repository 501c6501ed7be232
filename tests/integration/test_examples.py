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


SPOT = Path(__file__).resolve().parents[2] / "examples" / "spot_watcher.py"


class FakeMetadata:
    """A cloud's spot metadata endpoint on 127.0.0.1: 404 until ``reclaim()``, then AWS's notice."""

    def __init__(self) -> None:
        import http.server
        import threading

        owner = self
        self.reclaimed = False

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                body = b'{"action": "terminate", "time": "2026-12-07T12:00:00Z"}' if owner.reclaimed else b""
                self.send_response(200 if owner.reclaimed else 404)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/latest/meta-data/spot/instance-action"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reclaim(self) -> None:
        self.reclaimed = True

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def load_example(path: Path):
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


async def test_the_spot_watcher_example_yields_its_jobs_when_the_metadata_gives_notice(dsn, pool):
    import gpuq
    from tests.helpers import wait_status

    example, metadata = load_example(SPOT), FakeMetadata()
    try:
        async with running_server(dsn, poll_seconds=60) as srv:
            running = await gpuq.enqueue(pool, "train", {"steps": 10**6, "step_seconds": 0.005}, preemptible=True)
            ready = await gpuq.enqueue(pool, "train", {"steps": 1}, preemptible=True)  # held ready (prefetch 1)
            async with anyio.create_task_group() as tg:
                tg.start_soon(example.main, [srv.url, "--token", TOKEN, "--metadata-url", metadata.url,
                                             "--notice", "8", "--poll-seconds", "0.05"])
                await wait_status(pool, running, "leased")
                await wait_status(pool, ready, "leased")
                metadata.reclaim()
                with anyio.fail_after(8):  # the agent exits by the notice
                    await wait_status(pool, running, "pending")
                # main() returns once the agent has reported and left
            rows = {r["id"]: r for r in await pool.fetch(
                "SELECT id, status::text, attempts, preemptions FROM gpuq.jobs")}
    finally:
        metadata.close()
    assert (rows[running]["status"], rows[running]["attempts"], rows[running]["preemptions"]) == ("pending", 0, 1)
    assert (rows[ready]["status"], rows[ready]["attempts"], rows[ready]["preemptions"]) == ("pending", 0, 0)
