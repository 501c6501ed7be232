"""The dispatcher's batching part without a database: which credit wakes what, when a pass is due."""

import time

from gpuq.batches import Policy
from gpuq.config import ServerConfig
from gpuq.dispatcher.loop import Dispatcher
from gpuq.dispatcher.sessions import AgentSession, Sessions
from gpuq.dispatcher.trigger import Pass
from gpuq.protocol import Hello, encode
from gpuq.protocol.server_side import ServerProtocol


def agent(kinds: tuple[str, ...], batch: int, name: str = "a") -> AgentSession:
    proto = ServerProtocol(max_payload=1 << 20, max_messages_per_second=100, now=0.0)
    proto.receive(encode(Hello(name, kinds, 1, batch=batch)), 0.0)
    return AgentSession(proto, flush=lambda: None, id=f"{name}#1")


def sessions(*agents: AgentSession) -> Sessions:
    s = Sessions()
    for a in agents:
        s.add(a)
    return s


def dispatcher(**policies: Policy) -> Dispatcher:
    d = Dispatcher(None, ServerConfig(database_url="postgresql://unused"))
    d.batching.policies = dict(policies)
    return d


def test_freed_credit_wakes_the_agents_one_by_one_group_and_its_batched_kinds():
    d = dispatcher(embed=Policy(8))
    d._credit_freed(agent(("embed", "other"), batch=64))
    assert d.trigger._next.credit == {frozenset({"other"}), frozenset({"embed", "other"})}
    d = dispatcher(embed=Policy(8))
    d._credit_freed(agent(("embed", "other"), batch=0))  # takes no batches: one group, all its kinds
    assert d.trigger._next.credit == {frozenset({"embed", "other"})}


def test_a_kind_that_sent_nothing_waits_for_a_reason_and_a_partial_batch_for_its_time():
    b = dispatcher(embed=Policy(8, max_wait_ms=100)).batching
    b._short.add("embed")
    assert not b._worth_a_look("embed", Pass(), time.monotonic())
    assert b._worth_a_look("embed", Pass(credit={frozenset({"embed", "x"})}), time.monotonic())
    b._short.add("embed")
    b._due["embed"] = time.monotonic() + 0.1
    b._stale = False
    assert 0.05 < b.wait_left(sessions(agent(("embed",), batch=8))) <= 0.1  # the dispatcher wakes for it
    assert b.wait_left(sessions(agent(("embed",), batch=0))) is None  # nobody takes batches: nothing to wake for
    assert b._worth_a_look("embed", Pass(), time.monotonic() + 0.2)  # once due, it is looked at again


async def test_a_due_partial_batch_that_no_free_credit_can_take_wakes_nothing():
    """The dispatcher must not spin on a partial batch's timer while its takers are busy: a freed
    credit looks at the kind again."""
    d = dispatcher(embed=Policy(8, max_wait_ms=100))
    d.batching._stale = False  # the policies were just read
    busy = agent(("embed",), batch=8)
    busy.protocol.ledger.hold(1, "00000000-0000-0000-0000-000000000001", "embed")  # its one credit
    d.batching._due["embed"] = time.monotonic() - 1  # its partial batch is due
    idle = agent(("other",), batch=0, name="b")  # another agent has room: the loop asks for a timer
    d.sessions = sessions(busy, idle)
    assert [jobs async for jobs in d.batching.lease(d.sessions, Pass(), lambda: False)] == []
    assert d.batching.wait_left(d.sessions) is None


async def test_a_commit_of_outcomes_gives_a_kind_a_limit_held_back_another_look():
    """The agents' freed credit comes before the completer's commit frees a limit: a look then finds
    the key still full and sends nothing. The commit must wake the kind again (before, it waited
    for the next poll)."""
    d = dispatcher(embed=Policy(8))
    d.batching._short.add("embed")
    d._outcomes_written()
    assert "embed" in d.batching._short and not d.trigger._wake.is_set()  # no limit: nothing held it
    d.placing._key_limits = True
    d._outcomes_written()
    assert "embed" not in d.batching._short and d.trigger._wake.is_set()
