"""Lease cursors, the settled horizon and floors, as pure bookkeeping (docs/design.md, "Lease cursors")."""

import time

from gpuq.config import ServerConfig
from gpuq.dispatcher.cursors import Cursors
from gpuq.dispatcher.groups import GroupLeases
from gpuq.dispatcher.sessions import Sessions
from gpuq.dispatcher.trigger import Pass
from gpuq.dispatcher.tuning import Tuning


def cursors(**by_kind: tuple[int, int]) -> Cursors:
    c = Cursors(now=0.0)
    c.cursors = dict(by_kind)
    return c


def test_cursors_are_dropped_when_older_than_the_rewind_interval_or_when_asked():
    c = cursors(a=(0, 50))
    c.start_pass(1.0, rewind_all=False, rewind_every=2.0)
    assert c.cursors == {"a": (0, 50)}
    c.start_pass(3.0, rewind_all=False, rewind_every=2.0)  # past it
    assert c.cursors == {} and c.since == 3.0
    c.cursors = {"a": (0, 50)}
    c.start_pass(3.5, rewind_all=True, rewind_every=2.0)  # a reconnect or a '*'
    assert c.cursors == {}


def test_a_lease_moves_the_cursors_unless_a_drop_came_meanwhile():
    c = cursors(a=(5, 10))
    c.floors = {"a": 5}
    before = c.rewinds
    assert c.leased({"a": (5, 20), "b": (3, 7)}, before) == {"b": 3}  # a's floor is already 5
    assert c.cursors == {"a": (5, 20), "b": (3, 7)}
    before = c.rewinds
    c.announced("a", None)  # jobs moved back while the next lease ran
    assert c.leased({"a": (5, 30)}, before) == {} and "a" not in c.cursors


def test_a_lowered_or_new_floor_rewinds_its_kind_and_waits_for_the_writers_then():
    c = cursors(a=(0, 20), b=(0, 20))
    c.floors = {"a": 5, "b": 0}
    lowered = c.floors_recorded({"a": 0, "c": 2})  # a went down, c is new
    assert lowered == {"a", "c"} and c.floors == {"a": 0, "b": 0, "c": 2}
    assert c.cursors == {"b": (0, 20)}
    c.confirm_after(lowered, ["x1", "x2"])
    c.cursors["a"] = (0, 30)
    assert c.writers_running({"x1", "x2"}) == set() and c.cursors["a"] == (0, 30)  # none ended
    assert c.writers_running({"x2"}) == {"a", "c"} and "a" not in c.cursors  # x1 ended: rewind
    assert c.confirm_writers() == ["x2"]
    assert c.writers_running(set()) == {"a", "c"} and c.confirm == []


def test_the_settled_id_moves_only_once_the_horizons_writers_have_ended():
    c = Cursors(now=0.0)
    assert c.settle_due(0.0, every=0.01) and not c.settle_due(0.005, every=0.01)
    c.new_horizon(100, ["x1"])
    assert c.settled == 0 and c.horizon_writers() == ["x1"]
    c.horizon_ended()
    assert c.settled == 100 and c.horizon_writers() == []
    c.new_horizon(150, [])  # nobody writing: settled at once
    assert c.settled == 150


def test_a_new_listen_connection_starts_everything_afresh():
    """After a failover the old server's settled id and writers mean nothing: a settled id above
    the new server's ids would let cursors pass jobs not yet seen (they only moved up)."""
    c = cursors(a=(0, 900))
    c.floors_recorded({"a": 1})
    c.confirm_after({"a"}, ["x"])
    c.new_horizon(1000, [])
    c.new_horizon(1200, ["x9"])
    assert c.settle_due(0.0, every=60) and not c.settle_due(1.0, every=60)  # next look in a minute
    assert c.settled == 1000 and c.horizon_writers() == ["x9"]
    c.restart(now=5.0)
    assert c.floors == {} and c.confirm == [] and c.cursors == {} and c.since == 5.0
    assert c.settled == 0 and c.horizon_writers() == [] and c.settle_due(5.0, every=60)


async def a_pass(g: GroupLeases, listening: bool) -> None:
    async for _jobs in g.lease(Sessions(), Pass(every=True), listening, stopping=lambda: False):
        raise AssertionError("no agent: nothing leased")


async def test_a_listening_dispatcher_keeps_its_cursors_through_rewind_polls_polls():
    g = GroupLeases(None, ServerConfig(database_url="postgresql://unused", poll_seconds=2), Tuning(rewind_polls=10),
                    listen_pid=lambda: None, recheck=lambda kinds: None)
    g.cursors.cursors = {"a": (0, 50)}
    g.cursors.since = time.monotonic() - 3  # past poll_seconds, not past rewind_polls of them
    await a_pass(g, listening=True)
    assert g.cursors.cursors == {"a": (0, 50)}
    await a_pass(g, listening=False)  # polling only: every poll
    assert g.cursors.cursors == {}
    g.cursors.cursors = {"a": (0, 50)}
    g.cursors.since = time.monotonic() - 21
    await a_pass(g, listening=True)
    assert g.cursors.cursors == {}
