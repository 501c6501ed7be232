"""`gpuq dev`'s demo without a server: the handlers' payload rules and the producer's mix."""

from collections import Counter

import pytest

from gpuq import demo, demomix
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


def shapes(jobs):
    """What a newcomer should see in the mix, counted."""
    seen = Counter()
    for j in jobs:
        seen["plain"] += not j.placed and j.kind == "demo"
        seen["batched"] += j.kind == "embed"
        seen["placed"] += j.gpus == 1
        seen["multi-gpu"] += j.gpus >= 2
        seen["with memory"] += j.gpu_memory_mb is not None
        seen["a10"] += "gpu=a10" in j.labels
        seen["long with progress"] += bool(isinstance(j.payload, dict) and j.payload.get("steps"))
        seen["retried"] += "fail_attempts" in (j.payload or {})
        seen["dead"] += bool((j.payload or {}).get("fail")) and "fail_attempts" not in j.payload
    return seen


def test_the_mix_starts_with_one_of_every_shape_at_once():
    first = demomix.Mix(10, 0.05, demomix.fleet(3)).due(0.0)
    seen = shapes(first)
    for shape in ("plain", "batched", "placed", "multi-gpu", "with memory", "a10", "long with progress",
                  "retried", "dead"):
        assert seen[shape] >= 1, shape
    assert seen["batched"] == demomix.BATCH_ITEMS  # a burst: one full batch


def test_the_mix_keeps_its_pace_and_gives_nothing_twice():
    mix = demomix.Mix(10, 0.05, demomix.fleet(3))
    upto_a_minute = [j for t in range(61) for j in mix.due(float(t))]  # a tick a second
    assert mix.due(60.0) == []
    seen = shapes(upto_a_minute)
    assert 400 <= seen["plain"] <= 430  # 7 a second
    assert seen["long with progress"] >= 3 and seen["multi-gpu"] >= 3 and seen["dead"] == 3


def test_gpu_streams_follow_the_fleet_and_a_pool_without_agents_gets_none():
    def a_minute(agents):
        mix = demomix.Mix(10, 0.05, demomix.fleet(agents))
        return [j for t in range(61) for j in mix.due(float(t))]

    one_box = shapes(a_minute(1))
    assert one_box["a10"] == 0 and one_box["multi-gpu"] >= 1
    assert shapes(a_minute(0))["placed"] == 0
    # Twice the H100s: about twice the H100 jobs a minute.
    three, six = (len([j for j in a_minute(n) if "gpu=h100" in j.labels]) for n in (3, 6))
    assert six >= 1.8 * three


def test_a_producer_that_fell_behind_skips_what_was_due_long_ago():
    mix = demomix.Mix(10, 0.05, demomix.fleet(3))
    mix.due(0.0)
    late = shapes(mix.due(3600.0))  # a laptop that slept for an hour
    assert late["plain"] <= 7 * demomix.LAG_LIMIT_SECONDS + 1
