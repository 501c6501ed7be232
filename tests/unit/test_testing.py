"""gpuq.testing: a handler run on jobs built in memory, through the agent's own slots, with the
outcome the agent would report. No server, no database, no socket."""

import asyncio
import threading

import pytest

from gpuq.agent import PermanentError
from gpuq.protocol import Device
from gpuq.testing import LocalAgent, Update, run_batch, run_job


async def embed(job):
    if "text" not in job.payload:
        raise PermanentError("no text")
    job.progress(0.5, "tokenized", {"tokens": len(job.payload["text"])})
    return {"vector": (len(job.payload["text"]),), "job": [job.id, job.kind, job.attempt], "gpus": job.devices}


def train(job):
    """Sync: three steps of progress, then what it was given."""
    for step in range(3):
        job.progress(step / 3, f"step {step}")
    return {"payload": job.payload, "gpus": job.devices, "attempt": job.attempt}


# -- outcomes ------------------------------------------------------------------


def test_an_async_handler_is_done_with_its_result_as_the_server_stores_it():
    outcome = run_job(embed, {"text": "hello"}, kind="embed", attempt=2, job_id=42)
    assert outcome.done and not outcome.failed and outcome.error is None
    assert outcome.result == {"vector": [5], "job": [42, "embed", 2], "gpus": []}  # JSON: tuples are lists
    assert outcome.progress == (Update(0.5, "tokenized", {"tokens": 5}),)
    assert outcome.job.payload == {"text": "hello"} and outcome.job.lease_token


def test_a_sync_handler_runs_in_a_worker_thread_with_its_devices_attempt_and_progress_in_order():
    threads = []

    def handler(job):
        threads.append(threading.current_thread())
        return train(job)

    outcome = run_job(handler, devices=(0, 2), attempt=3)
    assert threads and threads[0] is not threading.main_thread()
    assert outcome.result == {"payload": {}, "gpus": [0, 2], "attempt": 3}  # no payload: {}, as enqueued
    assert [(u.fraction, u.message) for u in outcome.progress] == [(0.0, "step 0"), (1 / 3, "step 1"),
                                                                   (2 / 3, "step 2")]


def test_a_permanent_error_fails_for_good_and_any_other_is_retried_with_its_text():
    dead = run_job(embed, {})
    assert dead.failed and dead.permanent and not dead.retryable
    assert "PermanentError: no text" in dead.error

    def flaky(job):
        raise ConnectionError("the GPU fell off the bus")

    retried = run_job(flaky)
    assert retried.failed and retried.retryable and not retried.permanent and not retried.timed_out
    assert "ConnectionError: the GPU fell off the bus" in retried.error


def test_a_result_the_server_cannot_take_fails_permanently_as_the_agent_reports_it():
    assert "not JSON-serializable" in run_job(lambda job: {"at": object()}).error
    async def main():
        async with LocalAgent(lambda job: "x" * 2000, max_payload=1000) as agent:
            return await agent.run()

    too_big = asyncio.run(main())
    assert too_big.permanent and "over the server's limit" in too_big.error


def test_a_bad_progress_value_fails_the_job_in_the_handler():
    outcome = run_job(lambda job: job.progress(1.5))
    assert outcome.retryable and "ValueError" in outcome.error


# -- timeouts and cancels --------------------------------------------------------


def test_an_async_handler_past_its_timeout_is_cancelled_and_fails_timeout():
    stopped = []

    async def slow(job):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            stopped.append(job.id)
            raise

    outcome = run_job(slow, timeout=0.02)
    assert outcome.timed_out and outcome.retryable and outcome.error == "timeout"
    assert stopped == [outcome.job.id] and not outcome.cancelled and outcome.job.timeout == 0.02


def test_a_sync_handler_past_its_timeout_sees_job_cancelled_and_fails_timeout():
    def slow(job):
        while not job.cancelled:  # the agent's timer sets it
            threading.Event().wait(0.005)
        return "late"

    outcome = run_job(slow, timeout=0.02)
    assert outcome.timed_out and outcome.retryable and outcome.result is None


async def test_a_running_async_job_cancelled_fails_cancelled_and_its_handler_is_cancelled():
    stopped = asyncio.Event()

    async def long(job):
        job.progress(0.1, "loading")
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            stopped.set()
            raise

    async with LocalAgent(long) as agent:
        run = agent.start({"steps": 100})
        assert await run.progressed() == Update(0.1, "loading", None)
        run.cancel()
        outcome = await run
    assert stopped.is_set() and outcome.cancelled and outcome.job.cancelled
    assert outcome.failed and outcome.error == "cancelled" and not outcome.retryable


async def test_a_running_sync_job_cancelled_sees_job_cancelled_and_returns_early():
    def long(job):
        step = 0
        while not job.cancelled:
            job.progress(min(step / 1e6, 1.0))
            step += 1
        return {"stopped_at": step}

    async with LocalAgent(long) as agent:
        run = agent.start()
        await run.progressed(2)
        run.cancel()
        outcome = await run
    # The agent reports what it returned; the server has ended the job cancelled and fences it out.
    assert outcome.cancelled and outcome.done and outcome.result["stopped_at"] >= 2


async def test_a_job_cancelled_before_a_slot_frees_ends_at_once_and_never_runs():
    ran, release = [], asyncio.Event()

    async def handler(job):
        ran.append(job.id)
        await release.wait()
        return job.id

    async with LocalAgent(handler, capacity=1) as agent:
        first, second = agent.start(), agent.start()
        second.cancel()
        async with asyncio.timeout(10):  # a guard: it must not wait for the first job's slot
            assert (await second).error == "cancelled"
        release.set()
        assert (await first).result == first.job.id
    assert ran == [first.job.id]


async def test_progressed_says_when_the_job_ended_with_fewer_updates():
    async with LocalAgent(train) as agent:
        run = agent.start()
        assert (await run.progressed(3)).message == "step 2"
        with pytest.raises(AssertionError, match="ended after 3 progress updates, not 4"):
            await run.progressed(4)
        cancelled_late = run.cancel()
    assert cancelled_late is None and not (await run).cancelled  # a cancel after the end does nothing


async def test_jobs_on_one_device_run_one_after_another():
    running, most = set(), []

    async def on_gpu(job):
        running.add(job.id)
        most.append(len(running))
        await asyncio.sleep(0)
        running.discard(job.id)
        return job.devices

    async with LocalAgent(on_gpu, devices=[Device(0, "h100", 81920), Device(1, "h100", 81920)]) as agent:
        outcomes = [await run for run in [agent.start(devices=(0,)), agent.start(devices=(0, 1)),
                                          agent.start(devices=(1,))]]
    assert [o.result for o in outcomes] == [[0], [0, 1], [1]] and max(most) == 1


# -- batches -------------------------------------------------------------------------


def test_a_batch_handler_gets_the_jobs_in_one_call_and_each_keeps_its_own_outcome():
    calls = []

    async def embed_batch(jobs):
        calls.append([job.payload for job in jobs])
        for job in jobs:
            job.progress(1.0)
        return [len(job.payload["text"]) if job.payload.get("text") else PermanentError("no text")
                for job in jobs]

    outcomes = run_batch(embed_batch, [{"text": "hi"}, {}, {"text": "hello"}], kind="embed")
    assert calls == [[{"text": "hi"}, {}, {"text": "hello"}]]
    assert [(o.status, o.result, o.retryable) for o in outcomes] == [("done", 2, False), ("failed", None, False),
                                                                     ("done", 5, False)]
    assert "no text" in outcomes[1].error and all(len(o.progress) == 1 for o in outcomes)
    assert {o.job.batch for o in outcomes} == {1}


def test_a_batch_handler_that_raises_or_miscounts_fails_every_item():
    def boom(jobs):
        raise RuntimeError("out of memory")

    assert [o.retryable and "out of memory" in o.error for o in run_batch(boom, [1, 2])] == [True, True]
    short = run_batch(lambda jobs: [1], [1, 2])
    assert all(o.permanent and "returned a list of 1 for 2 jobs" in o.error for o in short)


def test_a_batch_past_its_timeout_fails_every_item_timeout():
    def slow(jobs):
        while not jobs[0].cancelled:
            threading.Event().wait(0.01)
        return [1] * len(jobs)

    assert [o.timed_out for o in run_batch(slow, [1, 2], timeout=0.02)] == [True, True]


async def test_a_single_job_goes_to_the_batch_handler_when_there_is_no_handler():
    async def embed_batch(jobs):
        return [len(jobs)] * len(jobs)

    async with LocalAgent(batch_handler=embed_batch) as agent:
        assert (await agent.run({"text": "x"})).result == 1
        assert [o.result for o in await agent.run_batch([1, 2, 3])] == [3, 3, 3]


# -- what a test may get wrong -----------------------------------------------------


async def test_run_job_in_an_async_test_says_to_use_a_local_agent():
    with pytest.raises(RuntimeError, match="LocalAgent"):
        run_job(embed, {"text": "x"})


async def test_a_job_no_server_could_push_is_refused():
    async with LocalAgent(embed, kinds=["embed"], devices=1) as agent:
        for bad in ({"kind": "train"}, {"devices": (1,)}, {"attempt": 0}, {"timeout": 0}):
            with pytest.raises(ValueError):
                agent.start({"text": "x"}, **bad)
        agent.start({"text": "x"}, job_id=7)
        with pytest.raises(ValueError, match="job 7 was started already"):
            agent.start({"text": "x"}, job_id=7)
    with pytest.raises(RuntimeError, match="async with"):
        LocalAgent(embed).start()
    with pytest.raises(ValueError, match="must both be async, or both sync"):
        LocalAgent(embed, batch_handler=lambda jobs: jobs)


# -- a cancel that comes before the handler starts -----------------------------------------


async def test_a_job_cancelled_before_its_handler_starts_never_runs_async_or_sync():
    ran = []

    async def handler(job):
        ran.append(job.id)
        return "ran"

    def sync_handler(job):
        ran.append(job.id)
        return "ran"

    for h in (handler, sync_handler):
        async with LocalAgent(h) as agent:
            run = agent.start()  # its slot is free: it would start now, but the cancel is read first
            run.cancel()
            outcome = await run
        assert outcome.cancelled and outcome.error == "cancelled", h
    assert ran == []
