"""The agent's side of the protocol as a state machine: no socket, no server."""

import json

import pytest

from gpuq.protocol import (
    Ack,
    Device,
    Hello,
    JobMessage,
    Jobs,
    ProtocolError,
    Results,
    ServerDrain,
    Welcome,
    parse_client,
)
from gpuq.protocol.agent_side import AgentProtocol

TOKEN = "00000000-0000-0000-0000-000000000000"
WELCOME = json.dumps({"type": "welcome", "agent_id": "a#1", "protocol": 1, "lease_seconds": 30,
                      "heartbeat_seconds": 5, "max_payload": 2048})


def job(i: int) -> JobMessage:
    return JobMessage(i, TOKEN, "embed", {"i": i}, 1)


def jobs_frame(*ids: int) -> str:
    return json.dumps({"type": "jobs", "jobs": [
        {"id": i, "lease_token": TOKEN, "kind": "embed", "payload": {"i": i}, "attempt": 1} for i in ids]})


def connected() -> AgentProtocol:
    p = AgentProtocol(Hello("a", ("embed",), 4))
    p.connection_made()
    assert [json.loads(f)["type"] for f in p.frames_to_send()] == ["hello"]
    assert isinstance(p.receive(WELCOME), Welcome)
    return p


def outcomes(p: AgentProtocol) -> list[dict]:
    return [o for f in p.frames_to_send() for o in json.loads(f).get("results", [json.loads(f)])]


def test_a_bad_hello_is_refused_before_connecting():
    with pytest.raises(ProtocolError):
        AgentProtocol(Hello("a", ("bad,kind",), 1))


def test_the_first_frame_must_be_a_welcome():
    p = AgentProtocol(Hello("a", ("embed",), 1))
    p.connection_made()
    with pytest.raises(ProtocolError, match="expected welcome"):
        p.receive(jobs_frame(1))


def test_outcomes_ready_together_go_in_one_results_frame_the_server_parses():
    p = connected()
    assert isinstance(p.receive(jobs_frame(1, 2, 3)), Jobs)
    p.job_done(job(1), {"ok": 1})
    p.job_failed(job(2), "boom", retryable=True)
    [frame] = p.frames_to_send()
    msg = parse_client(frame, 2048)
    assert [o.id for o in msg.outcomes] == [1, 2] and set(p.running) == {3}


def test_an_outcome_is_kept_until_acked_and_sent_again_after_a_reconnect():
    p = connected()
    p.receive(jobs_frame(1, 2))
    p.job_done(job(1), 1)
    p.job_done(job(2), 2)
    p.frames_to_send()
    assert p.receive('{"type": "ack", "accepted": [1], "rejected": []}') == Ack((1,), ())
    assert set(p.unacked) == {2} and p.completed == 1
    p.connection_lost()
    p.connection_made()
    assert [json.loads(f)["type"] for f in p.frames_to_send()] == ["hello"]  # nothing before the welcome
    p.receive(WELCOME)
    assert [o["id"] for o in outcomes(p)] == [2]


@pytest.mark.parametrize("result, reason", [
    (object(), "not JSON-serializable"), ("x" * 5000, "over the server's limit"),
    ({"t": "nul\x00"}, "U+0000"),
])
def test_a_result_the_server_cannot_take_becomes_a_permanent_failure(result, reason):
    p = connected()
    p.receive(jobs_frame(1))
    p.job_done(job(1), result)
    [out] = outcomes(p)
    assert out["type"] == "failed" and reason in out["error"] and out["retryable"] is False


def test_heartbeats_name_the_running_jobs_only_while_some_run():
    p = connected()
    p.heartbeat()
    assert p.frames_to_send() == []
    p.receive(jobs_frame(7, 8))
    p.heartbeat()
    assert [json.loads(f) for f in p.frames_to_send()] == [{"type": "heartbeat", "ids": [7, 8]}]


def test_drain_then_finished_once_nothing_runs_or_waits_for_an_ack():
    p = connected()
    p.receive(jobs_frame(1))
    p.drain()
    assert [json.loads(f)["type"] for f in p.frames_to_send()] == ["drain"] and not p.finished
    p.job_done(job(1), None)
    assert not p.finished  # not acked yet
    p.frames_to_send()
    p.receive('{"type": "ack", "accepted": [1], "rejected": []}')
    assert p.finished
    assert isinstance(p.receive('{"type": "drain", "deadline_seconds": 3}'), ServerDrain)


def test_a_drain_asked_while_disconnected_is_sent_after_the_next_welcome():
    p = AgentProtocol(Hello("a", ("embed",), 1))
    p.drain()
    p.connection_made()
    p.frames_to_send()
    p.receive(WELCOME)
    assert [json.loads(f)["type"] for f in p.frames_to_send()] == ["drain"]


def test_a_second_welcome_is_refused():
    p = connected()
    with pytest.raises(ProtocolError, match="second welcome"):
        p.receive(WELCOME)


def test_a_cancel_marks_the_running_jobs_it_names():
    from gpuq.protocol import Cancel

    p = connected()
    p.receive(jobs_frame(1, 2))
    running = dict(p.running)
    assert p.receive(json.dumps({"type": "cancel", "ids": [2, 3]})) == Cancel((2,))  # 3 is not running here
    assert running[2].cancelled and not running[1].cancelled
    p.job_failed(running[2], "cancelled", retryable=False)  # reported like any outcome; the server fences it
    assert 2 not in p.running and 2 in p.unacked


def progress_sent(p: AgentProtocol) -> list[dict]:
    return [u for f in p.frames_to_send() for u in json.loads(f).get("updates", [])]


def test_progress_keeps_the_latest_per_job_until_sent_and_asks_once():
    p = connected()
    p.receive(jobs_frame(1, 2))
    one, two = p.running[1], p.running[2]
    asks = []
    for j in (one, two):
        from gpuq.protocol import attach_reporter

        attach_reporter(j, lambda job_id, item: asks.append(p.progress(job_id, item)))
    one.progress(0.1)
    one.progress(0.2, "epoch 2", {"loss": 0.5})
    two.progress(1)
    assert asks == [True, False, False]  # one send asked for, however many updates
    assert progress_sent(p) == []  # nothing goes out before send_progress
    p.send_progress()
    assert progress_sent(p) == [
        {"id": 1, "lease_token": TOKEN, "fraction": 0.2, "message": "epoch 2", "data": {"loss": 0.5}},
        {"id": 2, "lease_token": TOKEN, "fraction": 1.0, "message": None, "data": None}]
    one.progress(0.3)
    assert asks[-1] is True  # the next update after a send asks again
    p.job_done(one, "ok")  # the outcome drops the unsent update
    p.send_progress()
    assert progress_sent(p) == []
    one.progress(0.4)  # not running any more: kept nowhere
    p.send_progress()
    assert progress_sent(p) == []


def test_progress_frames_parse_on_the_server_and_bad_values_fail_in_the_handler():
    from gpuq.protocol import Progress, ProgressUpdate, attach_reporter

    p = connected()
    p.receive(jobs_frame(1))
    job_ = p.running[1]
    attach_reporter(job_, p.progress)
    job_.progress(0.5, "half")
    p.send_progress()
    [frame] = p.frames_to_send()
    assert parse_client(frame, 4096) == Progress((ProgressUpdate(1, TOKEN, 0.5, "half", None),))
    for bad in (2, float("nan"), -1):
        with pytest.raises(ValueError, match="from 0 to 1"):
            job_.progress(bad)
    with pytest.raises(ValueError, match="not JSON-serializable"):
        job_.progress(0.5, data=object())


def test_progress_is_not_kept_across_a_reconnect():
    p = connected()
    p.receive(jobs_frame(1))
    assert p.progress(1, '{"id":1}')
    p.connection_lost()
    p.send_progress()  # the server released the job with the connection: nobody to tell
    p.connection_made()
    assert [json.loads(f)["type"] for f in p.frames_to_send()] == ["hello"]
    p.receive(WELCOME)
    assert p.frames_to_send() == []


# -- slots and prefetch (protocol 5) -------------------------------------------

WELCOME_5 = WELCOME.replace('"protocol": 1', '"protocol": 5')


def slots(capacity: int = 1, prefetch: int = 1) -> AgentProtocol:
    p = AgentProtocol(Hello("a", ("embed",), capacity, prefetch=prefetch))
    p.connection_made()
    assert json.loads(p.frames_to_send()[0])["prefetch"] == prefetch
    p.receive(WELCOME_5)
    return p


def pushed(p: AgentProtocol, *ids: int) -> list[int]:
    msg = p.receive(jobs_frame(*ids))
    return [j.id for j in p.take(msg.jobs)]


def test_a_slot_runs_one_job_and_the_next_waits_ready_until_it_ends():
    p = slots()
    assert pushed(p, 1, 2) == [1]
    assert [j.id for j in p.ready] == [2]
    first = p.running[1]
    p.job_started(first)
    p.job_done(first, None)
    [nxt] = p.next_jobs(first)
    assert nxt.id == 2 and not p.ready
    p.job_started(nxt)
    [frame] = [json.loads(f) for f in p.frames_to_send()]
    assert frame["type"] == "results" and frame["started"] == [1, 2]  # one frame: the outcome and both starts
    assert isinstance(parse_client(json.dumps(frame), 4096), Results)
    p.job_done(nxt, None)
    assert p.next_jobs(nxt) == []
    assert pushed(p, 3) == [3]  # the slot is free again


def test_a_start_without_an_outcome_goes_alone_and_an_older_server_never_hears_of_it():
    p = slots()
    pushed(p, 1)
    p.job_started(p.running[1])
    assert [json.loads(f) for f in p.frames_to_send()] == [{"type": "started", "ids": [1]}]
    old = connected()  # protocol 1
    old.take(old.receive(jobs_frame(1)).jobs)
    old.job_started(old.running[1])
    assert old.frames_to_send() == []


def test_a_cancelled_ready_job_ends_before_it_starts():
    p = slots()
    pushed(p, 1, 2)
    msg = p.receive(json.dumps({"type": "cancel", "ids": [1, 2]}))
    assert msg.ids == (1,)  # the running one: the I/O layer stops its handler
    assert not p.ready and 2 not in p.running
    assert [(o["id"], o["error"]) for o in outcomes(p)] == [(2, "cancelled")]


def test_drain_gives_the_ready_jobs_back_and_they_never_start():
    p = slots(capacity=1, prefetch=2)
    pushed(p, 1, 2, 3)
    p.drain()
    frames = [json.loads(f) for f in p.frames_to_send()]
    assert {"type": "release", "ids": [2, 3]} in frames
    assert set(p.running) == {1}
    first = p.running[1]
    p.job_done(first, None)
    assert p.next_jobs(first) == []


def test_a_lost_connection_drops_the_ready_jobs():
    p = slots()
    pushed(p, 1, 2)
    p.connection_lost()
    assert not p.ready and 2 not in p.running


def test_jobs_pushed_while_draining_that_cannot_start_go_back_at_once():
    p = slots()
    pushed(p, 1)
    p.drain()
    p.frames_to_send()
    assert pushed(p, 2) == []  # the push crossed the drain
    assert {"type": "release", "ids": [2]} in [json.loads(f) for f in p.frames_to_send()]
    assert set(p.running) == {1}


# -- jobs ready on busy devices, slot accounting (protocol 6) -----------------

WELCOME_6 = WELCOME.replace('"protocol": 1', '"protocol": 6')


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gpu_agent(clock: Clock, devices: int = 2, capacity: int = 1) -> AgentProtocol:
    hello = Hello("a", ("embed",), capacity, devices=tuple(Device(i, "gpu", 1024) for i in range(devices)),
                  prefetch=1)
    p = AgentProtocol(hello, clock=clock)
    p.connection_made()
    p.frames_to_send()
    p.receive(WELCOME_6)
    return p


def gpu_jobs(*jobs: tuple[int, list[int]], queued_ms: int = 0) -> str:
    return json.dumps({"type": "jobs", "jobs": [
        {"id": i, "lease_token": TOKEN, "kind": "embed", "payload": None, "attempt": 1, "devices": d,
         "queued_ms": queued_ms} for i, d in jobs]})


def finish(p: AgentProtocol, job_id: int) -> list[int]:
    job = p.running[job_id]
    p.job_done(job, None)
    return [j.id for j in p.next_jobs(job)]


def test_a_job_for_a_busy_device_starts_when_that_device_frees():
    p = gpu_agent(Clock())
    assert [j.id for j in p.take(p.receive(gpu_jobs((1, [0]), (2, [1]))).jobs)] == [1, 2]
    assert [j.id for j in p.take(p.receive(gpu_jobs((3, [0]))).jobs)] == []  # device 0 runs job 1
    assert [j.id for j in p.ready_gpu] == [3]
    assert finish(p, 2) == []  # device 1 freeing does nothing for it
    assert finish(p, 1) == [3]


def test_each_device_runs_its_jobs_in_push_order_so_a_multi_gpu_job_is_not_overtaken():
    p = gpu_agent(Clock())
    p.take(p.receive(gpu_jobs((1, [0]), (2, [1]))).jobs)
    assert p.take(p.receive(gpu_jobs((3, [0, 1]), (4, [0]))).jobs) == []
    assert finish(p, 1) == []  # device 0 is free, but job 3 came first and waits for device 1
    assert finish(p, 2) == [3]
    assert finish(p, 3) == [4]


def test_a_multi_gpu_job_frees_its_devices_for_several_ready_jobs_at_once():
    p = gpu_agent(Clock())
    p.take(p.receive(gpu_jobs((1, [0, 1]))).jobs)
    p.take(p.receive(gpu_jobs((2, [0]), (3, [1]))).jobs)
    assert finish(p, 1) == [2, 3]


def test_ready_gpu_jobs_are_released_on_drain_and_cancelled_before_they_start():
    p = gpu_agent(Clock())
    p.take(p.receive(gpu_jobs((1, [0]), (2, [1]))).jobs)
    p.take(p.receive(gpu_jobs((3, [0]), (4, [1]))).jobs)
    msg = p.receive(json.dumps({"type": "cancel", "ids": [3]}))
    assert msg.ids == () and 3 not in p.running
    p.drain()
    assert {"type": "release", "ids": [4]} in [json.loads(f) for f in p.frames_to_send()]
    assert finish(p, 2) == []


def heartbeat_slots(p: AgentProtocol) -> dict:
    p.heartbeat()
    [frame] = [json.loads(f) for f in p.frames_to_send() if json.loads(f)["type"] == "heartbeat"]
    return frame["slots"]


def test_gaps_count_only_while_the_next_job_waited_and_busy_time_is_the_handlers():
    clock = Clock()
    p = slots_6(clock, capacity=1)
    p.take(p.receive(jobs_frame_6((1, 0), (2, 0))).jobs)  # job 2 waits ready behind job 1
    first = p.running[1]
    p.job_started(first)
    clock.now += 0.020
    p.job_done(first, None)
    [nxt] = p.next_jobs(first)
    clock.now += 0.0005  # the next start, half a millisecond after
    p.job_started(nxt)
    clock.now += 0.020
    p.job_done(nxt, None)
    assert p.next_jobs(nxt) == []
    clock.now += 5.0  # the queue is empty: an idle slot, not a gap
    p.take(p.receive(jobs_frame_6((3, 0))).jobs)  # just enqueued: waited 0 ms
    clock.now += 0.002  # the push to the start
    third = p.running[3]
    p.job_started(third)
    s = heartbeat_slots(p)  # a job counts when it ends
    assert s["busy_ms"] == pytest.approx(40.0)
    assert s["idle_ms"] == pytest.approx(0.5)
    assert sum(s["gaps"]) == 2
    p.heartbeat()  # job 3 still runs: its lease is extended; nothing counted since the last report
    assert [json.loads(f) for f in p.frames_to_send()] == [{"type": "heartbeat", "ids": [3]}]
    clock.now += 0.010
    p.job_done(third, None)
    p.next_jobs(third)
    s = heartbeat_slots(p)
    assert (s["busy_ms"], s["idle_ms"], sum(s["gaps"])) == (pytest.approx(10.0), pytest.approx(2.0), 1)  # not 5 s


def test_a_handler_timed_in_its_thread_counts_its_own_start_and_end():
    clock = Clock()
    p = slots_6(clock, capacity=1)
    p.take(p.receive(jobs_frame_6((1, 0), (2, 0))).jobs)
    first = p.running[1]
    p.job_started(first)  # the loop hands it to a thread, which begins 1 ms later and runs 20 ms
    p.job_done(first, None)
    [nxt] = p.next_jobs(first, ran=(100.001, 100.021))
    clock.now = 100.022
    p.job_started(nxt)
    p.job_done(nxt, None)
    p.next_jobs(nxt, ran=(100.0235, 100.0435))  # its thread began 2.5 ms after the first one ended
    s = heartbeat_slots(p)
    assert s["busy_ms"] == pytest.approx(40.0)
    assert s["idle_ms"] == pytest.approx(2.5 + 1.0)  # the hand-offs to the threads are gaps, not busy time


def test_a_job_that_waited_before_a_slot_freed_counts_from_the_slot_freeing():
    clock = Clock()
    p = slots_6(clock, capacity=1, prefetch=0)
    p.take(p.receive(jobs_frame_6((1, 0))).jobs)
    p.job_started(p.running[1])
    clock.now += 1.0
    job = p.running[1]
    p.job_done(job, None)
    assert p.next_jobs(job) == []
    clock.now += 0.004  # the outcome's round trip and the next lease: a job that waited 10 s
    p.take(p.receive(jobs_frame_6((2, 10_000))).jobs)
    second = p.running[2]
    p.job_started(second)
    p.job_done(second, None)
    p.next_jobs(second)
    assert heartbeat_slots(p)["idle_ms"] == pytest.approx(4.0)


def test_an_older_server_gets_no_slot_report():
    p = slots()  # protocol 5
    pushed(p, 1)
    p.job_started(p.running[1])
    p.frames_to_send()
    p.heartbeat()
    assert all("slots" not in json.loads(f) for f in p.frames_to_send())


def slots_6(clock: Clock, capacity: int = 1, prefetch: int = 1) -> AgentProtocol:
    p = AgentProtocol(Hello("a", ("embed",), capacity, prefetch=prefetch), clock=clock)
    p.connection_made()
    p.frames_to_send()
    p.receive(WELCOME_6)
    return p


def jobs_frame_6(*jobs: tuple[int, int]) -> str:
    return json.dumps({"type": "jobs", "jobs": [
        {"id": i, "lease_token": TOKEN, "kind": "embed", "payload": None, "attempt": 1, "queued_ms": q}
        for i, q in jobs]})
