"""The dispatcher's placing part without a database: warm waits, when it wants a pass, limits."""

import time

from gpuq.config import ServerConfig
from gpuq.dispatcher.placing import Placing
from gpuq.dispatcher.roster import FleetAgent, Roster
from gpuq.dispatcher.sessions import AgentSession, Sessions
from gpuq.dispatcher.tuning import Tuning
from gpuq.jobs import Shape
from gpuq.protocol import Device, Hello, encode
from gpuq.protocol.server_side import ServerProtocol

MODEL = Shape("train", "s1", 1, None, frozenset(), "llama", False)
PLAIN = Shape("train", "s2", 1, None, frozenset(), None, False)


def agent(name: str, models: tuple[str, ...] = ()) -> AgentSession:
    proto = ServerProtocol(max_payload=1 << 20, max_messages_per_second=100, now=0.0)
    proto.receive(encode(Hello(name, ("train",), 1, devices=(Device(0, "gpu", 81920),), models=models)), 0.0)
    return AgentSession(proto, flush=lambda: None, id=f"{name}#1")


def placing(warm_wait: float = 5.0, *shapes: Shape) -> Placing:
    p = Placing(None, ServerConfig(database_url="postgresql://unused", warm_wait_seconds=warm_wait), Tuning(),
                Roster(None, Tuning(), Sessions()))
    if shapes:  # as if read just now
        p.shapes = {s.key: s for s in shapes}
        p._shapes_at, p._shapes_stale = time.monotonic(), False
    return p


def sessions(*agents: AgentSession) -> Sessions:
    s = Sessions()
    for a in agents:
        s.add(a)
    return s


def test_a_cold_agent_waits_for_the_warm_wait_while_the_model_is_warm_elsewhere_then_one_loads_it():
    warm, cold1, cold2 = agent("warm", ("llama",)), agent("cold1"), agent("cold2")
    p = placing(5.0, MODEL)
    fleet = sessions(warm, cold1, cold2)
    assert p._after_warm_wait(MODEL.key, MODEL, fleet, [cold1.id, cold2.id]) == []  # the wait starts
    assert 4.9 < p.wait_left(any_room=True) <= 5.0  # a pass is due when it ends
    p._warm_wait_ends[MODEL.key] = time.monotonic() - 0.01
    assert p._after_warm_wait(MODEL.key, MODEL, fleet, [cold1.id, cold2.id, cold1.id]) == [cold1.id, cold1.id]
    assert MODEL.key not in p._warm_wait_ends  # the next wait starts afresh


def test_a_model_warm_on_another_servers_agent_holds_a_cold_one_too():
    cold = agent("cold")
    p = placing(5.0, MODEL)
    elsewhere = FleetAgent("warm#2", "other-server", frozenset({"train"}), 6, (Device(0, "", 81920),),
                           frozenset({"llama"}), frozenset(), draining=False)
    p.roster._others = [elsewhere]  # as last read from gpuq.fleet_agents
    assert p._after_warm_wait(MODEL.key, MODEL, sessions(cold), [cold.id]) == []
    p.roster._others = [FleetAgent(**{**vars(elsewhere), "draining": True})]  # it takes nothing new: no wait
    p._warm_wait_ends.clear()
    assert p._after_warm_wait(MODEL.key, MODEL, sessions(cold), [cold.id]) == [cold.id]


def test_no_wait_when_nobody_holds_the_model_or_the_job_names_none():
    cold1, cold2 = agent("cold1"), agent("cold2")
    p = placing(5.0, MODEL, PLAIN)
    assert p._after_warm_wait(MODEL.key, MODEL, sessions(cold1, cold2), [cold1.id, cold2.id]) == [cold1.id, cold2.id]
    fleet = sessions(agent("warm", ("llama",)), cold1)
    assert p._after_warm_wait(PLAIN.key, PLAIN, fleet, [cold1.id]) == [cold1.id]
    assert placing(0.0, MODEL)._after_warm_wait(MODEL.key, MODEL, fleet, [cold1.id]) == [cold1.id]


def test_it_wants_a_pass_for_a_throttled_shapes_read_only_while_someone_has_room():
    p = placing(5.0)
    assert p.wait_left(any_room=False) is None
    assert p.wait_left(any_room=True) == 0  # never read: due now
    p._shapes_stale = False
    assert p.wait_left(any_room=True) is None


async def test_with_nobody_to_place_on_it_leases_nothing_and_reads_the_shapes_when_one_comes():
    p = placing(5.0, MODEL)
    leased = [jobs async for jobs in p.lease(Sessions(), every=False, kinds={"train"}, stopping=lambda: False)]
    assert leased == [] and p._shapes_stale


def test_an_outcome_gives_limited_shapes_that_came_up_short_another_try():
    p = placing(5.0, MODEL, PLAIN)
    p._short = {MODEL.key, PLAIN.key}
    assert not p.outcomes_written()  # no limits: nothing held back, no pass
    p._limited_kinds = frozenset({"train"})
    assert p.outcomes_written() and p._short == set()


def test_while_an_agent_is_reserved_it_wants_a_pass_at_the_next_check_of_the_reservation():
    p = placing(5.0, MODEL)
    assert p.wait_left(any_room=True) is None
    p.reserved = {"box#1": MODEL.key}
    p._reserve_at = time.monotonic() + 0.5
    assert 0.4 < p.wait_left(any_room=True) <= 0.5  # whether its shape still has a job waiting
