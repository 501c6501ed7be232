"""Shared dashboard reads: many callers, one read per key and period."""

import asyncio

import pytest

from gpuq.ui.shared import Shared
from tests.helpers import wait_for


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_callers_at_once_share_one_read_and_later_ones_read_again():
    clock, reads = Clock(), []

    async def read():
        reads.append(clock.now)
        await asyncio.sleep(0.01)  # not a settle wait: a read that takes a while, so the callers overlap
        return len(reads)

    shared = Shared(1.0, clock)
    assert await asyncio.gather(*(shared.get("overview", read) for _ in range(20))) == [1] * 20
    clock.now = 0.5
    assert await shared.get("overview", read) == 1  # still fresh
    assert await shared.get(("jobs", "dead"), read) == 2  # another key reads on its own
    clock.now = 1.0
    assert await shared.get("overview", read) == 3
    shared.clear()
    assert await shared.get("overview", read) == 4


async def test_a_failed_read_is_not_kept_and_a_caller_leaving_does_not_cancel_it():
    shared, calls = Shared(10.0), []

    async def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise ConnectionError("database away")
        await asyncio.sleep(0.05)  # not a settle wait: the read still runs when its caller leaves
        return "ok"

    with pytest.raises(ConnectionError):
        await shared.get("k", flaky)
    impatient = asyncio.ensure_future(shared.get("k", flaky))
    await wait_for(lambda: len(calls) == 2)  # its read has started
    impatient.cancel()
    assert await shared.get("k", flaky) == "ok" and len(calls) == 2  # the read went on for the next caller


async def test_a_slow_read_is_shared_longer_so_reads_take_a_bounded_share_of_the_database():
    from gpuq.ui.shared import LOAD_SHARE

    clock, reads = Clock(), []

    async def slow():
        reads.append(clock.now)
        clock.now += 0.1  # the read took 100 ms (a big backlog to count)
        return len(reads)

    shared = Shared(1.0, clock)
    assert await shared.get("overview", slow) == 1
    assert shared.keep("overview") == pytest.approx(0.1 / LOAD_SHARE)  # 5 s, not 1
    clock.now = 3.0
    assert await shared.get("overview", slow) == 1
    clock.now = 5.2
    assert await shared.get("overview", slow) == 2
