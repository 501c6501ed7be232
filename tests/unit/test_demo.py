"""`gpuq dev`'s demo without a server: the handlers' payload rules."""

import pytest

from gpuq import demo
from gpuq.protocol import JobMessage
from gpuq.protocol.messages import attach_reporter


def job(payload, attempt=1, job_id=1):
    return JobMessage(job_id, "token", "demo", payload, attempt)


async def test_a_job_with_steps_reports_progress_each_step():
    j, seen = job({"seconds": 0.03, "steps": 3}), []
    attach_reporter(j, lambda _id, item: seen.append(item))
    assert (await demo.handle(j))["ok"]
    assert len(seen) == 3 and '"step 1/3"' in seen[0] and '"step 3/3"' in seen[-1]


async def test_fail_attempts_fails_the_first_attempts_only_and_fail_every_one():
    flaky = {"seconds": 0, "fail_attempts": 1, "fail": "NCCL timeout"}
    with pytest.raises(RuntimeError, match="NCCL timeout"):
        await demo.handle(job(flaky, attempt=1))
    assert (await demo.handle(job(flaky, attempt=2)))["attempt"] == 2
    with pytest.raises(RuntimeError, match="requested by the payload"):
        await demo.handle(job({"seconds": 0, "fail": True}, attempt=3))


async def test_a_batch_gets_one_entry_per_job_and_a_failing_item_fails_alone():
    out = await demo.handle_batch([job({"seconds": 0}, job_id=1), job({"seconds": 0, "fail": "bad"}, job_id=2)])
    assert out[0] == {"ok": True, "job": 1, "batch_size": 2}
    assert isinstance(out[1], RuntimeError) and str(out[1]) == "bad"
