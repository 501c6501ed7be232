"""run_every's outage log: one warning when failures begin, one line when they end."""

import anyio

from gpuq.loops import LoopBackoff, Outage, run_every


class _Lines:
    def __init__(self):
        self.lines = []

    def __getattr__(self, level):
        return lambda event, **fields: self.lines.append((level, event, fields))


async def test_an_outage_is_logged_once_and_its_end_once():
    log = _Lines()
    outcomes = iter([OSError("refused")] * 5 + [None, None, OSError("reset"), None])
    left = [9]

    async def step():
        left[0] -= 1
        if (exc := next(outcomes)) is not None:
            raise exc

    with anyio.fail_after(5):
        await run_every(0, step, backoff=LoopBackoff(first=0.001, cap=0.002), errors=(OSError,),
                        outage=Outage(log, "listen.lost", component="x"), until=lambda: left[0] == 0)
    warnings = [(e, f["error"]) for level, e, f in log.lines if level == "warning"]
    assert warnings == [("listen.lost", "refused"), ("listen.lost", "reset")]
    ended = [f for level, e, f in log.lines if e == "listen.recovered"]
    assert [f["failures"] for f in ended] == [5, 1]
    assert all(f["component"] == "x" for f in ended)
    assert sum(level == "debug" for level, _, _ in log.lines) == 4


def test_a_long_outage_is_recalled_now_and_then():
    log = _Lines()
    outage = Outage(log, "lease.failed", remind_seconds=0)
    for _ in range(3):
        outage.failed(OSError("down"), 1.0)
    assert [level for level, _, _ in log.lines] == ["warning"] * 3
    assert log.lines[-1][2]["failures"] == 3


async def test_an_outage_ended_inside_a_long_step_starts_the_backoff_afresh():
    """A LISTEN step holds its connection for hours and ends only by failing: each loss after a
    reconnect is a new outage, retried at the first delay, not at the last one's capped delay."""
    log = _Lines()
    outage = Outage(log, "listen.lost")
    waits = []
    left = [4]

    async def step():
        left[0] -= 1
        outage.ended()  # connected and listening: the outage (if any) is over
        raise OSError("closed")

    with anyio.fail_after(5):
        await run_every(0, step, backoff=LoopBackoff(first=0.001, cap=1.0, jitter=0), errors=(OSError,),
                        outage=outage, on_error=lambda exc, retry_in: waits.append(retry_in),
                        until=lambda: left[0] == 0)
    assert waits == [0.001] * 4
    assert [e for level, e, _ in log.lines if level == "warning"] == ["listen.lost"] * 4
