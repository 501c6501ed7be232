"""Protocol 7, batches, on the agent's side: a push's batches checked, taken as one slot each,
started, cancelled, released and counted as one; and the batch handler's contract. No socket."""

import json

import pytest

from gpuq.agent.batches import record_raised, record_returned
from gpuq.agent.handlers import PermanentError
from gpuq.protocol import Device, ErrorCode, Hello, JobMessage, ProtocolError
from gpuq.protocol.agent_side import AgentProtocol
from gpuq.protocol.batches import Batch, check_batches

TOKEN = "00000000-0000-0000-0000-000000000000"


def welcome(version: int) -> str:
    return json.dumps({"type": "welcome", "agent_id": "a#1", "protocol": version, "lease_seconds": 30,
                       "heartbeat_seconds": 5, "max_payload": 1 << 20})


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def agent(batch: int = 4, capacity: int = 1, prefetch: int = 1, version: int = 7, devices: int = 0,
          clock: Clock | None = None) -> AgentProtocol:
    hello = Hello("a", ("embed", "other"), capacity, devices=tuple(Device(i, "gpu", 1024) for i in range(devices)),
                  prefetch=prefetch, batch=batch)
    p = AgentProtocol(hello, clock=clock or Clock())
    p.connection_made()
    assert json.loads(p.frames_to_send()[0])["batch"] == batch
    p.receive(welcome(version))
    return p


def item(i: int, batch: int | None = None, kind: str = "embed", devices: list[int] | None = None,
         timeout: int | None = None, queued_ms: int | None = None) -> dict:
    out = {"id": i, "lease_token": TOKEN, "kind": kind, "payload": {"i": i}, "attempt": 1}
    for key, value in (("batch", batch), ("devices", devices), ("timeout", timeout), ("queued_ms", queued_ms)):
        if value is not None:
            out[key] = value
    return out


def push(p: AgentProtocol, *items: dict) -> list:
    msg = p.receive(json.dumps({"type": "jobs", "jobs": list(items)}))
    return p.take(msg.jobs)


def shape(units: list) -> list:
    """A unit as its job ids: a batch as a list, a job as its id."""
    return [[j.id for j in u.jobs] if isinstance(u, Batch) else u.id for u in units]


def sent(p: AgentProtocol) -> list[dict]:
    return [json.loads(f) for f in p.frames_to_send()]


def test_a_batch_is_one_unit_in_one_slot_and_the_next_waits_ready():
    p = agent(capacity=1)
    now = push(p, item(1, 1), item(2, 1), item(3, 1), item(4), item(5, 2), item(6, 2))
    assert shape(now) == [[1, 2, 3]]
    assert shape(p.ready) == [4, [5, 6]]
    assert set(p.running) == {1, 2, 3, 4, 5, 6}
    [batch] = now
    p.job_started(batch)
    assert sent(p) == [{"type": "started", "ids": [1, 2, 3]}]  # every item of the batch
    for job in batch.jobs:
        p.job_done(job, job.id)
    [single] = p.next_jobs(batch)
    assert single.id == 4
    p.job_done(single, None)
    assert shape(p.next_jobs(single)) == [[5, 6]]


def test_the_batch_runs_under_its_items_smallest_timeout_and_counts_the_oldest_wait():
    p = agent()
    [batch] = push(p, item(1, 1, timeout=30, queued_ms=5), item(2, 1, queued_ms=40), item(3, 1, timeout=10))
    assert (batch.timeout, batch.queued_ms, batch.kind, batch.devices) == (10.0, 40, "embed", ())
    [lone] = push(agent(), item(1, 1))
    assert (lone.timeout, lone.queued_ms) == (None, None)


def test_a_gpu_batch_takes_its_devices_once_and_frees_them_for_the_next():
    p = agent(devices=1)
    now = push(p, item(1, 1, devices=[0]), item(2, 1, devices=[0]), item(3, devices=[0]))
    assert shape(now) == [[1, 2]] and shape(p.ready_gpu) == [3]
    [batch] = now
    p.job_started(batch)
    for job in batch.jobs:
        p.job_done(job, None)
    assert shape(p.next_jobs(batch)) == [3]


@pytest.mark.parametrize("items, batch, message", [
    ([item(1, 1)], 0, "takes no batches"),
    ([item(1, 1), item(2, 1), item(3, 1)], 2, "more than 2 items"),
    ([item(1, 1), item(2), item(3, 1)], 4, "split"),
    ([item(1, 1), item(2, 1, kind="other")], 4, "mixes kinds or devices"),
    ([item(1, 1, devices=[0]), item(2, 1, devices=[1])], 4, "mixes kinds or devices"),
])
def test_a_push_that_breaks_a_batch_rule_is_a_protocol_error_and_nothing_of_it_is_kept(items, batch, message):
    p = agent(batch=batch, devices=2)
    with pytest.raises(ProtocolError, match=message) as err:
        p.receive(json.dumps({"type": "jobs", "jobs": items}))
    assert err.value.code == ErrorCode.BAD_MESSAGE and not err.value.fatal
    assert p.running == {}


def test_an_older_connection_takes_no_batch_whatever_the_hello_said():
    p = agent(batch=4, version=6)
    with pytest.raises(ProtocolError, match="takes no batches"):
        p.receive(json.dumps({"type": "jobs", "jobs": [item(1, 1)]}))
    assert shape(push(p, item(1))) == [1]  # single jobs as before


def test_check_batches_lets_jobs_without_a_batch_through_to_any_agent():
    check_batches([JobMessage(1, TOKEN, "embed", None, 1)], 0)


def test_a_cancelled_item_of_a_ready_batch_ends_at_once_and_the_batch_goes_on_without_it():
    p = agent(capacity=1)
    push(p, item(1), item(2, 1), item(3, 1), item(4, 2))
    msg = p.receive(json.dumps({"type": "cancel", "ids": [2, 4]}))
    assert msg.ids == ()  # nothing running to stop
    assert shape(p.ready) == [[3]]
    assert [(o["id"], o["error"], o["retryable"]) for o in sent(p)[0]["results"]] == [
        (2, "cancelled", False), (4, "cancelled", False)]
    assert set(p.running) == {1, 3}


def test_a_cancelled_item_of_a_running_batch_is_only_marked():
    p = agent()
    [batch] = push(p, item(1, 1), item(2, 1))
    p.job_started(batch)
    msg = p.receive(json.dumps({"type": "cancel", "ids": [2]}))
    assert msg.ids == (2,) and batch.jobs[1].cancelled and not batch.jobs[0].cancelled
    assert set(p.running) == {1, 2}


def test_drain_releases_every_item_of_a_ready_batch_and_a_lost_connection_drops_it():
    p = agent(capacity=1)
    push(p, item(1), item(2, 1), item(3, 1))
    p.drain()
    assert {"type": "release", "ids": [2, 3]} in sent(p)
    assert not p.ready and set(p.running) == {1}
    q = agent(capacity=1)
    push(q, item(1), item(2, 1), item(3, 1))
    q.connection_lost()
    assert set(q.running) == {1}


def test_the_slot_clock_counts_a_batch_as_one_job():
    clock = Clock()
    p = agent(capacity=1, clock=clock)
    [batch] = push(p, item(1, 1, queued_ms=0), item(2, 1, queued_ms=0), item(3, 1, queued_ms=0))
    p.job_started(batch)
    clock.now += 0.020
    for job in batch.jobs:
        p.job_done(job, None)
    p.next_jobs(batch)
    p.heartbeat()
    [beat] = [f for f in sent(p) if f["type"] == "heartbeat"]
    assert beat["slots"]["busy_ms"] == pytest.approx(20.0) and sum(beat["slots"]["gaps"]) == 1


# -- the batch handler's contract -----------------------------------------------------


def running_batch(n: int = 3) -> tuple[AgentProtocol, list[JobMessage]]:
    p = agent()
    [batch] = push(p, *(item(i, 1) for i in range(1, n + 1)))
    p.job_started(batch)
    p.frames_to_send()
    return p, list(batch.jobs)


def results(p: AgentProtocol) -> dict[int, tuple]:
    return {o["id"]: (o["type"], o.get("result"), o.get("error", "").splitlines()[-1:], o.get("retryable"))
            for f in sent(p) for o in f.get("results", [])}


def test_each_entry_is_its_items_outcome_and_an_exception_fails_that_item_alone():
    p, jobs = running_batch(4)
    record_returned(p, jobs, [{"a": 1}, ValueError("bad item"), PermanentError("never"), None])
    assert results(p) == {1: ("done", {"a": 1}, [], None),
                          2: ("failed", None, ["ValueError: bad item"], True),
                          3: ("failed", None, ["gpuq.agent.handlers.PermanentError: never"], False),
                          4: ("done", None, [], None)}


@pytest.mark.parametrize("returned, got", [([1, 2], "a list of 2"), ((1, 2, 3), "tuple"), (None, "NoneType")])
def test_a_wrong_shape_fails_every_item_permanently_and_says_why(returned, got):
    p, jobs = running_batch(3)
    record_returned(p, jobs, returned)
    out = results(p)
    assert set(out) == {1, 2, 3} and all(o[0] == "failed" and o[3] is False for o in out.values())
    assert out[1][2] == [f"the batch handler returned {got} for 3 jobs: it must return a list with one entry "
                         "per job, in order"]


def test_raising_fails_every_item_retryable_unless_permanent():
    p, jobs = running_batch(2)
    record_raised(p, jobs, RuntimeError("gpu fell over"))
    assert {i: o[3] for i, o in results(p).items()} == {1: True, 2: True}
    p, jobs = running_batch(2)
    record_raised(p, jobs, PermanentError("bad model"))
    assert {i: o[3] for i, o in results(p).items()} == {1: False, 2: False}


def test_a_cancelled_item_ends_cancelled_its_result_discarded_and_the_others_stand():
    p, jobs = running_batch(3)
    p.receive(json.dumps({"type": "cancel", "ids": [2]}))
    record_returned(p, jobs, ["a", "b", "c"])
    assert results(p) == {1: ("done", "a", [], None), 2: ("failed", None, ["cancelled"], False),
                          3: ("done", "c", [], None)}


def test_past_the_timeout_every_item_fails_timeout_retryable():
    p, jobs = running_batch(2)
    record_returned(p, jobs, ["a", "b"], expired=True)
    assert results(p) == {1: ("failed", None, ["timeout"], True), 2: ("failed", None, ["timeout"], True)}


def test_an_object_whose_call_is_async_runs_as_an_async_handler():
    from gpuq.agent import Agent
    from gpuq.agent.async_slots import AsyncSlots

    class Handler:
        async def __call__(self, jobs):
            return [None for _ in jobs]

    agent = Agent("ws://127.0.0.1:1/agent", "t", ["embed"], 1, batch_handler=Handler(), devices=())
    assert isinstance(agent._slots, AsyncSlots)  # not a worker thread that never awaits it
    plain = Agent("ws://127.0.0.1:1/agent", "t", ["embed"], 1, Handler(), devices=())
    assert isinstance(plain._slots, AsyncSlots)
