"""The README's code examples, run as written against a live server, so they cannot drift."""

import ast
import inspect
import io
import re
from pathlib import Path

import anyio

from gpuq import admin
from gpuq.harness import running_server
from gpuq.jobs import NewJob
from gpuq.producer import enqueue_many
from tests.helpers import reset_tracer_provider, wait_for, wait_status

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()
RUN_LINE = "asyncio.run(agent.run_until_signal())"
TESTING = "from gpuq.testing import"  # the block that tests handlers (it has an agent of its own)


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, re.DOTALL)


async def run_python(code: str, namespace: dict) -> None:
    """Run a snippet with top-level ``await`` in ``namespace``."""
    compiled = compile(code, "README.md", "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    result = eval(compiled, namespace)  # noqa: S307 - our own README
    if result is not None:
        await result


async def test_the_sql_producer_example_inserts_jobs_the_queue_takes(conn):
    [sql] = blocks("sql")
    await conn.execute(sql)
    rows = await conn.fetch("SELECT kind, status::text, priority, max_attempts FROM gpuq.jobs ORDER BY id")
    assert [tuple(r) for r in rows] == [("embed", "pending", 0, 5), ("train", "scheduled", 10, 3)]


async def test_the_python_producer_example(pool):
    [producer] = [b for b in blocks("python") if "enqueue_many" in b]
    namespace = {"dsn_or_pool": pool, "pool": pool}
    await run_python(producer, namespace)
    assert isinstance(namespace["job_id"], int) and len(namespace["ids"]) == 1000
    assert await pool.fetchval("SELECT dedup_key FROM gpuq.jobs WHERE id = $1", namespace["job_id"]) == "doc-42"


async def test_the_ten_line_agent_example_runs_jobs(dsn, pool):
    [agent_code] = [b for b in blocks("python") if "class" not in b and "Agent(" in b and "devices" not in b
                    and "batch_handler" not in b and TESTING not in b]
    assert agent_code.rstrip().splitlines()[-1].startswith(RUN_LINE)
    body = agent_code.replace(RUN_LINE, "")
    async with running_server(dsn, tokens=frozenset({"s3cret"})) as srv:
        namespace: dict = {}
        await run_python(body.replace("ws://127.0.0.1:8765/agent", srv.url), namespace)
        agent = namespace["agent"]
        srv.agents.append(agent)
        srv.tg.start_soon(agent.run)
        good = await pool.fetchval("INSERT INTO gpuq.jobs (kind, payload) VALUES ('embed', "
                                   "'{\"text\": \"hello\"}') RETURNING id")
        bad = await pool.fetchval("INSERT INTO gpuq.jobs (kind, payload) VALUES ('embed', '{}') RETURNING id")
        await wait_status(pool, good, "done")
        await wait_status(pool, bad, "dead")
        await wait_for(lambda: agent.completed == 2, timeout=5)
    assert await pool.fetchval("SELECT result FROM gpuq.jobs WHERE id = $1", good) == {"vector": [5]}
    assert "no text" in await pool.fetchval("SELECT last_error FROM gpuq.jobs WHERE id = $1", bad)


async def test_the_long_jobs_example_cancels_a_job_and_shows_it(pool):
    [example] = [b for b in blocks("python") if "gpuq.cancel" in b]
    namespace = {"pool": pool}
    await run_python(example, namespace)
    assert namespace["cancelled"] == {namespace["job_id"]: "pending"}
    assert namespace["job"]["status"] == "cancelled" and namespace["result"] is None
    assert namespace["job"]["timeout_seconds"] == 3600

    class Job:  # the sync handler reports each step, and stops at the first step once cancelled
        payload, cancelled, reported = {"steps": 2}, False, []

        def progress(self, *args):
            self.reported.append(args)

    job = Job()
    assert namespace["train"](job) is None
    assert job.reported == [(0.0, "step 0/2", {"loss": 1.0}), (0.5, "step 1/2", {"loss": 0.5})]
    job.cancelled = True
    assert namespace["train"](job) == {"stopped_at": 0}


async def test_the_preemption_example_yields_at_a_step_and_resumes_without_counting_the_attempt(dsn, pool):
    import threading

    from gpuq import preempt

    [example] = [b for b in blocks("python") if "gpuq.preempt(" in b]
    saved: list[int] = []
    stepping = threading.Event()

    def train_step(job, step):  # a step takes until the job is asked to yield (the first run)
        stepping.set()
        while not job.preempted and not saved:
            threading.Event().wait(0.002)

    namespace = {"pool": pool, "train_step": train_step, "save_checkpoint": lambda job, step: saved.append(step)}
    await run_python(example, namespace)
    job_id = namespace["job_id"]
    assert namespace["asked"] == {}  # pending: nothing to ask
    async with running_server(dsn, poll_seconds=60) as srv:
        await srv.agent(["train"], 1, namespace["train"])
        with anyio.fail_after(10):
            await anyio.to_thread.run_sync(stepping.wait)
        assert await preempt(pool, job_id) == {job_id: 60.0}
        await wait_status(pool, job_id, "done")
    row = await pool.fetchrow("SELECT attempts, preemptions, result FROM gpuq.jobs WHERE id = $1", job_id)
    assert (row["attempts"], row["preemptions"], row["result"]) == (1, 1, {"steps": 600}) and saved == [1]


async def test_the_checkpoint_example_resumes_a_retried_job_from_its_last_checkpoint(dsn, pool):
    [example] = [b for b in blocks("python") if "job.checkpoint(" in b]
    steps_run: list[int] = []

    async def run_step(step: int) -> None:
        steps_run.append(step)
        if step == 73 and steps_run.count(73) == 1:  # the first attempt fails past its checkpoint at 50
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    async def save_weights(step: int) -> str:
        return f"s3://runs/42/{step}.pt"

    namespace = {"run_step": run_step, "save_weights": save_weights}
    await run_python(example, namespace)
    async with running_server(dsn, sweep_seconds=0.05) as srv:  # the retry is promoted at once
        await srv.agent(["train"], 1, namespace["train"])
        job_id = await enqueue_many(pool, [NewJob("train", {"steps": 120})])
        await wait_status(pool, job_id[0], "done", timeout=30)
    shown = await admin.show(pool, job_id[0])
    assert shown["result"] == {"steps": 120, "resumed_from": 50}
    assert shown["attempts"] == 2 and steps_run.count(50) == 2 and steps_run.count(49) == 1  # one interval redone
    assert shown["checkpoint"] == {"step": 100, "weights": "s3://runs/42/100.pt"}


async def test_the_gpu_example_runs_a_two_gpu_job_on_its_two_devices(dsn, pool):
    [agent_code] = [b for b in blocks("python") if "Agent(" in b and "job.devices" in b and TESTING not in b]
    [producer] = [b for b in blocks("python") if "gpus=2" in b and "Agent(" not in b]
    run_line = next(line for line in agent_code.splitlines() if line.startswith(RUN_LINE))
    async with running_server(dsn, tokens=frozenset({"s3cret"})) as srv:
        namespace: dict = {}
        await run_python(agent_code.replace(run_line, "").replace("ws://127.0.0.1:8765/agent", srv.url), namespace)
        agent = namespace["agent"]
        srv.agents.append(agent)
        srv.tg.start_soon(agent.run)
        await run_python(producer, {"gpuq": __import__("gpuq"), "dsn_or_pool": pool, **namespace})
        job_id = await pool.fetchval("SELECT max(id) FROM gpuq.jobs")
        await wait_status(pool, job_id, "done")
    result = await pool.fetchval("SELECT result->>'saw' FROM gpuq.jobs WHERE id = $1", job_id)
    assert result == "0,1"


async def test_the_batching_example_runs_jobs_in_one_call_each_with_its_own_result(dsn, pool):
    [agent_code] = [b for b in blocks("python") if "batch_handler=" in b]
    run_line = next(line for line in agent_code.splitlines() if line.startswith(RUN_LINE))
    await admin.set_batching(pool, "embed", 64)
    ids = await enqueue_many(pool, [NewJob("embed", {"text": "hello"}), NewJob("embed", {}, max_attempts=1),
                                    NewJob("embed", {"text": "hi"})])
    calls: list = []
    async with running_server(dsn, tokens=frozenset({"s3cret"})) as srv:
        namespace: dict = {}
        await run_python(agent_code.replace(run_line, "").replace("ws://127.0.0.1:8765/agent", srv.url), namespace)
        handler = namespace["embed_batch"]

        async def counted(jobs):
            calls.append(len(jobs))
            return await handler(jobs)

        agent = namespace["agent"]
        agent.batch_handler = counted
        srv.agents.append(agent)
        srv.tg.start_soon(agent.run)
        for job_id, status in zip(ids, ("done", "dead", "done"), strict=True):
            await wait_status(pool, job_id, status)
    assert calls == [3]
    assert [await pool.fetchval("SELECT result FROM gpuq.jobs WHERE id = $1", i) for i in (ids[0], ids[2])] == [
        {"vector": [5]}, {"vector": [2]}]
    assert "no text" in await pool.fetchval("SELECT last_error FROM gpuq.jobs WHERE id = $1", ids[1])


async def test_the_testing_example_tests_a_handler_with_no_server_and_no_database():
    [example] = [b for b in blocks("python") if TESTING in b]
    namespace: dict = {}
    await run_python(example, namespace)
    tests = {name: f for name, f in namespace.items() if name.startswith("test_")}
    assert len(tests) == 4
    for test in tests.values():  # the README's own asserts; a sync one outside this event loop
        await (test() if inspect.iscoroutinefunction(test) else anyio.to_thread.run_sync(test))


async def test_the_tracing_example_stores_the_trace_of_its_span(pool):
    [example] = [b for b in blocks("python") if "set_tracer_provider" in b]
    assert "ConsoleSpanExporter()" in example
    namespace = {"pool": pool, "out": io.StringIO()}  # the exporter's default stdout is the one at its import
    reset_tracer_provider()
    try:
        await run_python(example.replace("ConsoleSpanExporter()", "ConsoleSpanExporter(out=out)"), namespace)
        namespace["provider"].shutdown()  # exports what the batch processor holds
    finally:
        reset_tracer_provider()
    printed = namespace["out"].getvalue()
    assert '"name": "enqueue embed"' in printed and '"name": "handle request"' in printed
    traceparent = await pool.fetchval("SELECT traceparent FROM gpuq.jobs WHERE id = $1", namespace["job_id"])
    assert f'"trace_id": "0x{traceparent[3:35]}"' in printed
