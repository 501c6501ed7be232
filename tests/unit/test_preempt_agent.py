"""A preempted job in the agent's slots (``LocalAgent``: the agent's own slots, no server): the handler
sees it, may yield early, is stopped at the deadline, and a result it returns anyway is kept."""

import asyncio
import os
import threading

import anyio

from gpuq.agent import JobPreempted, on_preempt, run_process
from gpuq.testing import LocalAgent
from tests.helpers import wait_for


async def test_an_async_handler_that_yields_early_is_reported_preempted():
    async def handle(job):
        asked = asyncio.Event()
        on_preempt(job, asked.set)
        await asked.wait()
        raise JobPreempted("checkpointed at step 3")

    async with LocalAgent(handle) as agent:
        run = agent.start({})
        run.preempt(grace_seconds=60)
        with anyio.fail_after(5):
            outcome = await run
    assert outcome.status == "preempted" and run.job.preempted


async def test_an_async_handler_that_ignores_the_preempt_is_cancelled_at_the_deadline():
    stopped = asyncio.Event()

    async def handle(job):
        if job.payload.get("next"):
            return "ran"
        try:
            await asyncio.Event().wait()  # never set: runs until stopped
        except asyncio.CancelledError:
            stopped.set()
            raise

    async with LocalAgent(handle, capacity=1) as agent:
        run = agent.start({})
        nxt = agent.start({"next": True})  # waits ready for the slot
        run.preempt(grace_seconds=0.05)
        with anyio.fail_after(5):
            outcome = await run
            assert (await nxt).result == "ran"  # the slot goes on with its next job
    assert stopped.is_set() and outcome.status == "preempted"


async def test_a_handler_that_finishes_before_the_deadline_keeps_its_result():
    async def handle(job):
        asked = asyncio.Event()
        on_preempt(job, asked.set)
        await asked.wait()
        return {"finished": True}

    async with LocalAgent(handle) as agent:
        run = agent.start({})
        run.preempt(grace_seconds=60)
        with anyio.fail_after(5):
            outcome = await run
    assert outcome.done and outcome.result == {"finished": True}


async def test_a_sync_handler_sees_job_preempted_and_any_exception_then_is_a_preemption():
    started = threading.Event()

    def handle(job):
        started.set()
        while not job.preempted:
            threading.Event().wait(0.005)  # the handler's own step loop
        raise RuntimeError("stopped to yield")

    async with LocalAgent(handle) as agent:
        run = agent.start({})
        with anyio.fail_after(5):
            await anyio.to_thread.run_sync(started.wait)
        run.preempt(grace_seconds=60)
        with anyio.fail_after(5):
            outcome = await run
    assert outcome.status == "preempted"


async def test_a_job_waiting_ready_goes_back_at_once():
    release = asyncio.Event()

    async def handle(job):
        await release.wait()
        return "ran"

    async with LocalAgent(handle, capacity=1) as agent:
        first, second = agent.start({}), agent.start({})
        second.preempt(grace_seconds=60)
        with anyio.fail_after(5):
            assert (await second).status == "preempted"
        release.set()
        with anyio.fail_after(5):
            assert (await first).done


async def test_a_run_process_child_gets_sigterm_at_the_preempt_and_sigkill_at_the_deadline(tmp_path):
    pid_file, term_file = tmp_path / "pid", tmp_path / "term"
    # The child notes SIGTERM and goes on (a checkpoint that takes too long): the deadline kills it.
    script = f"trap 'echo term > {term_file}' TERM; echo $$ > {pid_file}; while :; do sleep 0.05; done"
    ready = asyncio.Event()

    async def handle(job):
        ready.set()
        await run_process("sh", "-c", script)

    async with LocalAgent(handle) as agent:
        run = agent.start({})
        with anyio.fail_after(5):
            await ready.wait()
        await wait_for(lambda: pid_file.exists() and pid_file.read_text().strip(), timeout=5)
        run.preempt(grace_seconds=0.5)
        with anyio.fail_after(5):
            outcome = await run
    assert outcome.status == "preempted"
    assert term_file.read_text().strip() == "term"
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 0)
        alive = True
    except ProcessLookupError:
        alive = False
    assert not alive
