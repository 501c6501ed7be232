"""Preemption on the wire (protocol 9): the messages, both sides' rules, placement's gate, the job's fields."""

import json

import pytest

from gpuq import placement
from gpuq.jobs import NewJob, Shape
from gpuq.protocol import (
    ErrorCode,
    Hello,
    JobMessage,
    Preempt,
    Preempted,
    ProtocolError,
    Results,
    Welcome,
    encode,
    mark_preempted,
    on_preempt,
    parse_client,
    parse_server,
)
from gpuq.protocol.agent_side import AgentProtocol
from gpuq.protocol.server_side import FrameRefused, HelloReceived, OutcomesReceived, ServerProtocol
from tests.unit.test_placement_rules import Box

TOKEN = "00000000-0000-0000-0000-000000000000"


def test_preempt_and_preempted_round_trip():
    assert parse_server(encode(Preempt((4, 5), 2.5))) == Preempt((4, 5), 2.5)
    assert parse_client(encode(Preempted(4, TOKEN)), 4096) == Preempted(4, TOKEN)
    frame = encode(Results((Preempted(4, TOKEN),)))
    assert parse_client(frame, 4096) == Results((Preempted(4, TOKEN),))


@pytest.mark.parametrize("body", [
    {"ids": [1], "deadline_seconds": -1}, {"ids": [1], "deadline_seconds": "5"},
    {"ids": [1], "deadline_seconds": True}, {"ids": "1", "deadline_seconds": 5}, {"ids": [1]},
])
def test_a_malformed_preempt_is_refused(body):
    with pytest.raises(ProtocolError):
        parse_server(json.dumps({"type": "preempt", **body}))


def server(version: int) -> ServerProtocol:
    p = ServerProtocol(max_payload=4096, max_messages_per_second=1000, now=0.0)
    hello = {"type": "hello", "agent": "a", "kinds": ["embed"], "capacity": 2, "protocol": version}
    if version >= 4:
        hello.update(devices=[], labels=[], models=[], prefetch=0, batch=0)
    if version < 5:
        hello.pop("prefetch", None)
    if version < 7:
        hello.pop("batch", None)
    [event] = p.receive(json.dumps(hello), 0.0)
    assert isinstance(event, HelloReceived)
    p.accept(Welcome("a#1", 30, 5, 4096, version))
    p.frames_to_send()
    return p


class Leased:
    def __init__(self, id):
        self.id, self.lease_token, self.kind, self.payload_json, self.attempt = id, TOKEN, "embed", "{}", 1


def test_a_version_9_agent_is_asked_to_yield_the_jobs_it_holds_and_its_preempted_outcome_frees_the_credit():
    p = server(9)
    p.send_jobs([Leased(7)])
    p.frames_to_send()
    assert p.preempt([7, 99], 3.0) == [7]
    assert [json.loads(f) for f in p.frames_to_send()] == [{"type": "preempt", "ids": [7], "deadline_seconds": 3.0}]
    assert p.ledger.free == 1
    [event] = p.receive(encode(Results((Preempted(7, TOKEN),))), 0.0)
    assert isinstance(event, OutcomesReceived)
    assert (event.outcomes, event.freed) == ([(Preempted(7, TOKEN), "embed")], 1)
    assert p.ledger.free == 2


def test_a_version_8_agent_is_never_sent_preempt_and_may_not_send_preempted():
    p = server(8)
    p.send_jobs([Leased(7)])
    p.frames_to_send()
    assert p.preempt([7], 3.0) == [] and p.frames_to_send() == []
    [event] = p.receive(encode(Preempted(7, TOKEN)), 0.0)
    assert isinstance(event, FrameRefused) and event.code == ErrorCode.UNEXPECTED
    assert 7 in p.ledger.held


def agent(capacity: int = 1, prefetch: int = 1) -> AgentProtocol:
    p = AgentProtocol(Hello("a", ("embed",), capacity, prefetch=prefetch), clock=lambda: 100.0)
    p.connection_made()
    p.frames_to_send()
    p.receive(encode(Welcome("a#1", 30, 5, 4096)))
    return p


def pushed(p: AgentProtocol, *ids: int) -> list:
    frame = json.dumps({"type": "jobs", "jobs": [
        {"id": i, "lease_token": TOKEN, "kind": "embed", "payload": {}, "attempt": 1} for i in ids]})
    return p.take(p.receive(frame).jobs)


def test_the_agent_marks_running_jobs_preempted_and_gives_back_the_ready_ones():
    p = agent()
    [first] = pushed(p, 1, 2)  # 2 waits ready
    p.job_started(first)
    p.frames_to_send()
    msg = p.receive(encode(Preempt((1, 2, 3), 5.0)))
    assert msg == Preempt((1,), 5.0)  # 2 never started here, 3 is not ours
    assert first.preempted and first.preempt_deadline == 105.0
    assert [json.loads(f) for f in p.frames_to_send()] == [{"type": "release", "ids": [2]}]
    assert not p.ready and 2 not in p.running
    p.job_preempted(first)
    [frame] = p.frames_to_send()
    assert parse_client(frame, 4096) == Results((Preempted(1, TOKEN),))
    assert 1 in p.unacked  # kept, and sent again after a reconnect, until acked


def test_on_preempt_calls_back_once_at_the_preempt_or_at_once_after_it():
    job, calls = JobMessage(1, TOKEN, "embed", {}, 1), []
    on_preempt(job, lambda: calls.append("early"))
    assert not job.preempted and calls == []
    mark_preempted(job, 10.0)
    mark_preempted(job, 20.0)  # a second preempt changes nothing
    on_preempt(job, lambda: calls.append("late"))
    assert calls == ["early", "late"] and job.preempt_deadline == 10.0


def test_only_a_version_9_agent_could_run_a_preemptible_shape():
    shape = Shape("train", "d", 0, None, frozenset(), None, False, preemptible=True)
    old, new = Box("old", version=8), Box("new", version=9)
    assert not placement.could_run(shape, old) and placement.could_run(shape, new)
    assert placement.slots(shape, [old, new], 10) == ["new"]
    assert "protocol 9" in (placement.why_unplaceable(shape, [old]) or "")
    assert placement.could_run(Shape("train", "d", 0, None, frozenset(), None, False), old)


def test_a_preemptible_job_is_placed_and_its_values_are_checked():
    assert NewJob("train", preemptible=True).placed and not NewJob("train").placed
    job = NewJob.from_mapping({"kind": "train", "preemptible": True, "grace": 5, "max_preemptions": 2})
    assert (job.grace_seconds, job.max_preemptions) == (5, 2)
    with pytest.raises(ValueError, match="grace"):
        NewJob("train", preemptible=True, grace_seconds=0)
    with pytest.raises(ValueError, match="max_preemptions"):
        NewJob("train", max_preemptions=-1)
    with pytest.raises(ValueError, match="preemptible"):
        NewJob.from_mapping({"kind": "train", "preemptible": "yes"})


def test_a_pushed_job_with_grace_seconds_is_preemptible_and_yield_running_marks_only_those():
    p = agent(capacity=2, prefetch=0)
    frame = json.dumps({"type": "jobs", "jobs": [
        {"id": 1, "lease_token": TOKEN, "kind": "embed", "payload": {}, "attempt": 1, "grace_seconds": 30},
        {"id": 2, "lease_token": TOKEN, "kind": "embed", "payload": {}, "attempt": 1},
        {"id": 3, "lease_token": TOKEN, "kind": "embed", "payload": {}, "attempt": 1, "grace_seconds": 2}]})
    jobs = {j.id: j for j in p.receive(frame).jobs}
    assert (jobs[1].grace_seconds, jobs[2].grace_seconds) == (30.0, None)
    assert p.yield_running(within=10) == (1, 3)
    assert (jobs[1].preempt_deadline, jobs[3].preempt_deadline) == (110.0, 102.0)  # the sooner of the two
    assert not jobs[2].preempted
    with pytest.raises(ProtocolError):
        parse_server(frame.replace('"grace_seconds": 2', '"grace_seconds": 0'))


def test_once_the_agent_leaves_a_push_that_crossed_the_drain_goes_back_whole():
    p = agent(capacity=2, prefetch=0)
    p.drain()
    p.frames_to_send()
    p.yield_running(within=5)  # an interruption: nothing runs yet
    assert pushed(p, 1, 2) == []  # a free slot or not, none starts
    assert [json.loads(f) for f in p.frames_to_send()] == [{"type": "release", "ids": [1, 2]}]
    assert not p.running and p.finished
