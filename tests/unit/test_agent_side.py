"""The agent's side of the protocol as a state machine: no socket, no server."""

import json

import pytest

from gpuq.protocol import (
    Ack,
    Hello,
    JobMessage,
    Jobs,
    ProtocolError,
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
