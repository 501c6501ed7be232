"""The server's side of the agent protocol as a state machine: no socket, no database."""

import json

import pytest

from gpuq.protocol import CloseCode, ErrorCode, Hello, Welcome, encode
from gpuq.protocol.server_side import (
    DrainRequested,
    FrameRefused,
    HeartbeatReceived,
    HelloReceived,
    JobsReleased,
    OutcomesReceived,
    ServerProtocol,
    SlotsReported,
    State,
)
from gpuq.protocol.slots import SlotReport

TOKEN = "00000000-0000-0000-0000-000000000000"
HELLO = json.dumps({"type": "hello", "agent": "a", "kinds": ["embed"], "capacity": 2, "protocol": 1})


class Leased:
    def __init__(self, id, lease_token=TOKEN, kind="embed", payload_json="{}", attempt=1):
        self.id, self.lease_token, self.kind, self.payload_json, self.attempt = (
            id, lease_token, kind, payload_json, attempt)


def opened(version: int = 1, **kw) -> ServerProtocol:
    p = ServerProtocol(max_payload=kw.pop("max_payload", 4096), max_messages_per_second=kw.pop("rate", 1000),
                       now=0.0, **kw)
    hello = HELLO.replace('"protocol": 1', f'"protocol": {version}')
    assert p.receive(hello, 0.0) == [HelloReceived(Hello("a", ("embed",), 2, version))]
    assert p.version == version
    p.accept(Welcome("a#1", 30, 5, 4096))
    assert json.loads(p.frames_to_send()[0])["type"] == "welcome"
    return p


def sent(p: ServerProtocol) -> list[dict]:
    return [json.loads(f) for f in p.frames_to_send()]


@pytest.mark.parametrize("frame, code", [
    ("not json", ErrorCode.BAD_JSON),
    ("[1, 2]", ErrorCode.BAD_MESSAGE),
    ('{"type": "nope"}', ErrorCode.UNKNOWN_TYPE),
    ('{"type": "done", "id": 1, "lease_token": "' + TOKEN + '"}', ErrorCode.BAD_MESSAGE),
    ('{"type": "done", "id": 1, "lease_token": "x", "result": 1}', ErrorCode.BAD_MESSAGE),
    ('{"type": "done", "id": -5, "lease_token": "' + TOKEN + '", "result": 1}', ErrorCode.BAD_MESSAGE),
    ('{"type": "failed", "id": 7, "lease_token": "' + TOKEN + '", "error": "x", "retryable": "yes"}',
     ErrorCode.BAD_MESSAGE),
    ('{"type": "heartbeat", "ids": [7]}', ErrorCode.NOT_HELD),
    (HELLO, ErrorCode.UNEXPECTED),
    ('{"type": "done", "id": 1, "lease_token": "' + TOKEN + '", "result": NaN}', ErrorCode.BAD_JSON),
    ('{"type": "results", "results": []}', ErrorCode.BAD_MESSAGE),
    ('{"type": "results", "results": "done"}', ErrorCode.BAD_MESSAGE),
    ('{"type": "results", "results": [1]}', ErrorCode.BAD_MESSAGE),
    ('{"type": "results", "results": [{"type": "heartbeat", "ids": []}]}', ErrorCode.BAD_MESSAGE),
    ('{"type": "results", "results": [{"type": "done", "id": 1, "lease_token": "x", "result": 1}]}',
     ErrorCode.BAD_MESSAGE),
    ('{"type": "results", "results": [{"type": "done", "id": 1, "lease_token": "' + TOKEN
     + '", "result": 1}, {"type": "done", "id": 2, "lease_token": "' + TOKEN + '", "result": "\\u0000"}]}',
     ErrorCode.BAD_MESSAGE),
])
def test_a_bad_frame_gets_an_error_and_the_connection_goes_on(frame, code):
    p = opened()
    events = p.receive(frame, 0.1)
    assert [type(e) for e in events] == [FrameRefused] and events[0].code == code
    [err] = sent(p)
    assert err["type"] == "error" and err["code"] == code and err["message"]
    assert p.close_to_send() is None and p.state is State.OPEN


def hello_but(**change) -> str:
    """A protocol 1 hello of agent x for kind a, capacity 1, but with ``change``."""
    return json.dumps({"type": "hello", "agent": "x", "kinds": ["a"], "capacity": 1, "protocol": 1, **change})


@pytest.mark.parametrize("hello, close", [
    ('{"type": "heartbeat", "ids": []}', CloseCode.PROTOCOL_ERROR),
    (hello_but(kinds=[]), CloseCode.PROTOCOL_ERROR),
    (hello_but(kinds=["a,b"]), CloseCode.PROTOCOL_ERROR),
    (hello_but(capacity=0), CloseCode.PROTOCOL_ERROR),
    (hello_but(protocol=99), CloseCode.UNSUPPORTED_VERSION),
    ("garbage", CloseCode.PROTOCOL_ERROR),
    (b"\x00binary", CloseCode.PROTOCOL_ERROR),
    # Found by the fuzzer: a reason of 120 characters can be over the 123 bytes a close frame holds.
    (hello_but(protocol=["é" * 200]), CloseCode.UNSUPPORTED_VERSION),
])
def test_a_bad_first_message_is_answered_then_closes(hello, close):
    p = ServerProtocol(max_payload=4096, max_messages_per_second=10, now=0.0)
    [refused] = p.receive(hello, 0.0)
    assert isinstance(refused, FrameRefused)
    assert [json.loads(f)["type"] for f in p.frames_to_send()] == ["error"]
    code, reason = p.close_to_send()
    assert code == close and len(reason.encode()) <= 123
    assert p.receive(HELLO, 0.1) == [] and p.ledger.free == 0  # closed: nothing more is taken


def test_a_second_hello_with_a_long_non_ascii_version_closes_with_4000():
    p = opened()
    p.receive(json.dumps({"type": "hello", "agent": "x", "kinds": ["a"], "capacity": 1, "protocol": "ü" * 200}),
              0.1)
    code, reason = p.close_to_send()
    assert code == CloseCode.PROTOCOL_ERROR and len(reason.encode()) <= 123


def test_a_binary_frame_after_the_hello_closes_with_1003():
    p = opened()
    p.receive(b"\x00\x01binary", 0.1)
    assert p.close_to_send()[0] == CloseCode.UNSUPPORTED_DATA


def test_no_hello_before_the_deadline_closes_with_4002():
    p = ServerProtocol(max_payload=4096, max_messages_per_second=10, now=100.0, hello_timeout=10)
    p.check_deadline(109.9)
    assert p.close_to_send() is None
    p.check_deadline(110.0)
    assert p.close_to_send() == (CloseCode.HELLO_TIMEOUT, "no hello in time")
    opened().check_deadline(1e9)  # the deadline means nothing once the hello came


def test_too_many_errors_close_with_4000():
    p = opened(max_errors=5)
    for _ in range(5):
        p.receive("nope", 0.1)
    assert p.close_to_send() is None
    p.receive("nope", 0.1)
    assert p.close_to_send() == (CloseCode.PROTOCOL_ERROR, "too many protocol errors")


def test_a_flood_closes_with_4008_and_a_steady_rate_does_not():
    beat = json.dumps({"type": "heartbeat", "ids": []})
    steady = opened(rate=20)
    for i in range(200):  # 20 a second for 10 seconds
        steady.receive(beat, i / 20)
    assert steady.close_to_send() is None
    flood = opened(rate=20)
    for _ in range(41):  # a burst of 2 seconds' worth, then one more at the same instant
        flood.receive(beat, 1.0)
    assert flood.close_to_send() == (CloseCode.RATE_LIMITED, "too many messages")


def test_credit_is_capacity_minus_held_jobs_and_a_matching_outcome_frees_it():
    p = opened()
    assert p.ledger.free == 2
    p.send_jobs([Leased(1), Leased(2, kind="other")])
    [frame] = sent(p)
    assert [j["id"] for j in frame["jobs"]] == [1, 2] and p.ledger.free == 0
    stale = json.dumps({"type": "done", "id": 1, "lease_token": "11111111-1111-1111-1111-111111111111",
                        "result": 1})
    [ev] = p.receive(stale, 0.1)
    assert isinstance(ev, OutcomesReceived) and ev.freed == 0 and ev.outcomes[0][1] == "?"
    good = json.dumps({"type": "results", "results": [
        {"type": "done", "id": 2, "lease_token": TOKEN, "result": 1},
        {"type": "failed", "id": 99, "lease_token": TOKEN, "error": "x", "retryable": True}]})
    [ev] = p.receive(good, 0.2)
    assert ev.freed == 1 and [(m.id, kind) for m, kind in ev.outcomes] == [(2, "other"), (99, "?")]
    assert p.ledger.free == 1 and set(p.ledger.held) == {1}


def test_a_heartbeat_extends_only_held_jobs_and_names_the_others():
    p = opened()
    p.send_jobs([Leased(1)])
    events = p.receive(json.dumps({"type": "heartbeat", "ids": [1, 5]}), 0.1)
    assert events[0] == HeartbeatReceived((1,))
    assert isinstance(events[1], FrameRefused) and events[1].code == ErrorCode.NOT_HELD
    err = sent(p)[-1]
    assert err["code"] == "not_held" and "[5]" in err["message"]


def test_drain_takes_the_credit_away():
    p = opened()
    assert p.receive('{"type": "drain"}', 0.1) == [DrainRequested()]
    assert p.ledger.free == 0 and p.draining


def test_acks_and_drain_go_out_in_order():
    p = opened()
    p.send_ack((1, 2), (3,))
    p.send_drain(5.0)
    assert sent(p) == [{"type": "ack", "accepted": [1, 2], "rejected": [3]},
                       {"type": "drain", "deadline_seconds": 5.0}]
    assert encode(Hello("a", ("embed",), 2, 1)) == json.dumps(json.loads(HELLO), separators=(",", ":"))


def test_a_version_2_agent_is_told_which_of_its_jobs_were_cancelled():
    p = opened(version=2)
    p.send_jobs([Leased(7), Leased(8)])
    p.frames_to_send()
    assert p.cancel([8, 99]) == [8]  # 99 is not held here
    assert sent(p) == [{"type": "cancel", "ids": [8]}]
    assert p.ledger.held.keys() == {7, 8}  # held, with its credit, until the agent reports it
    assert p.cancel([99]) == [] and sent(p) == []


def test_a_version_1_agent_gets_no_cancel_message_and_keeps_working():
    p = opened(version=1)
    p.send_jobs([Leased(7)])
    p.frames_to_send()
    assert p.cancel([7]) == [] and sent(p) == []


@pytest.mark.parametrize("version", [0, 10, True, "2"])
def test_an_unknown_protocol_version_is_refused_with_4003(version):
    p = ServerProtocol(max_payload=4096, max_messages_per_second=1000, now=0.0)
    p.receive(HELLO.replace('"protocol": 1', f'"protocol": {json.dumps(version)}'), 0.0)
    assert p.close_to_send()[0] == CloseCode.UNSUPPORTED_VERSION


def progress_frame(*updates: dict) -> str:
    return json.dumps({"type": "progress", "updates": [
        {"id": 7, "lease_token": TOKEN, "fraction": 0.5, "message": None, "data": None, **u} for u in updates]})


def test_progress_counts_only_for_held_jobs_with_their_token():
    from gpuq.protocol import ProgressUpdate
    from gpuq.protocol.server_side import ProgressReceived

    p = opened(version=3)
    p.send_jobs([Leased(7), Leased(8)])
    p.frames_to_send()
    other = "11111111-1111-1111-1111-111111111111"
    events = p.receive(progress_frame({"fraction": 1, "message": "m", "data": {"loss": 0.5}},
                                      {"id": 8, "lease_token": other}, {"id": 99}), 0.0)
    assert events == [ProgressReceived((ProgressUpdate(7, TOKEN, 1.0, "m", {"loss": 0.5}),))]
    assert p.receive(progress_frame({"id": 99}), 0.0) == []  # not held: dropped, no error
    assert sent(p) == [] and p.errors == 0


@pytest.mark.parametrize("update, needle", [
    ({"fraction": 1.5}, "fraction must be a number from 0 to 1"),
    ({"fraction": -0.1}, "fraction"),
    ({"fraction": True}, "fraction"),
    ({"fraction": "0.5"}, "fraction"),
    ({"message": 5}, "message must be a string"),
    ({"data": "x" * 9000}, "over the limit of 8192"),
    ({"data": {"k": "\u0000"}}, "U+0000"),
    ({"extra": 1}, "exactly data, fraction, id, lease_token, message"),
])
def test_a_bad_progress_update_is_refused_and_the_connection_goes_on(update, needle):
    p = opened(version=3, max_payload=65536)
    p.send_jobs([Leased(7)])
    p.frames_to_send()
    [refused] = p.receive(progress_frame(update), 0.0)
    assert isinstance(refused, FrameRefused) and refused.code == ErrorCode.BAD_MESSAGE
    assert needle in refused.message
    assert p.state is State.OPEN


def test_progress_needs_version_3():
    p = opened(version=2)
    p.send_jobs([Leased(7)])
    p.frames_to_send()
    [refused] = p.receive(progress_frame({}), 0.0)
    assert refused.code == ErrorCode.UNEXPECTED and "protocol 3" in refused.message


def test_a_long_progress_message_is_cut_not_refused():
    p = opened(version=3, max_payload=65536)
    p.send_jobs([Leased(7)])
    [event] = p.receive(progress_frame({"message": "é" * 5000}), 0.0)
    assert event.updates[0].message == "é" * 1024


# -- prefetch (protocol 5) --------------------------------------------------------

def opened_5(capacity: int = 1, prefetch: int = 1) -> ServerProtocol:
    p = ServerProtocol(max_payload=4096, max_messages_per_second=1000, now=0.0)
    [event] = p.receive(json.dumps({"type": "hello", "agent": "a", "kinds": ["embed"], "capacity": capacity,
                                    "protocol": 5, "devices": [], "labels": [], "models": [],
                                    "prefetch": prefetch}), 0.0)
    assert isinstance(event, HelloReceived) and event.hello.prefetch == prefetch
    return p


def test_prefetch_adds_credit_and_held_jobs_are_unstarted_until_the_agent_says():
    p = opened_5(capacity=1, prefetch=2)
    assert p.ledger.free == 3
    p.send_jobs([Leased(1), Leased(2), Leased(3)])
    assert p.ledger.free == 0 and p.ledger.unstarted() == [1, 2, 3]
    assert p.receive(json.dumps({"type": "started", "ids": [1, 99]}), 0.0) == []  # 99: not held, ignored
    assert p.ledger.unstarted() == [2, 3]
    done = {"type": "done", "id": 1, "lease_token": TOKEN, "result": None}
    [event] = p.receive(json.dumps({"type": "results", "started": [2], "results": [done]}), 0.0)
    assert isinstance(event, OutcomesReceived) and event.freed == 1
    assert p.ledger.unstarted() == [3] and p.ledger.free == 1


def test_release_gives_back_only_unstarted_held_jobs():
    p = opened_5(capacity=1, prefetch=2)
    p.send_jobs([Leased(1), Leased(2), Leased(3)])
    p.receive(json.dumps({"type": "started", "ids": [1]}), 0.0)
    [event] = p.receive(json.dumps({"type": "release", "ids": [1, 2, 3, 42]}), 0.0)
    assert event == JobsReleased(((2, TOKEN), (3, TOKEN)))
    assert list(p.ledger.held) == [1]


@pytest.mark.parametrize("frame", [
    '{"type": "started", "ids": [1]}', '{"type": "release", "ids": [1]}',
    '{"type": "results", "started": [1], "results": [{"type": "done", "id": 1, "lease_token": "' + TOKEN
    + '", "result": null}]}',
])
def test_prefetch_messages_need_version_5(frame):
    p = opened(1)
    [event] = p.receive(frame, 0.0)
    assert isinstance(event, FrameRefused) and event.code == ErrorCode.UNEXPECTED
    assert p.ledger.unstarted() == []  # before version 5 every pushed job starts at once


def test_a_version_4_hello_has_no_prefetch():
    p = ServerProtocol(max_payload=4096, max_messages_per_second=1000, now=0.0)
    p.receive(json.dumps({"type": "hello", "agent": "a", "kinds": ["embed"], "capacity": 2, "protocol": 4,
                          "devices": [], "labels": [], "models": []}), 0.0)
    assert p.ledger.prefetch == 0 and p.ledger.free == 2
    bad = ServerProtocol(max_payload=4096, max_messages_per_second=1000, now=0.0)
    [refused] = bad.receive(json.dumps({"type": "hello", "agent": "a", "kinds": ["embed"], "capacity": 2,
                                        "protocol": 4, "devices": [], "labels": [], "models": [],
                                        "prefetch": 1}), 0.0)
    assert isinstance(refused, FrameRefused)


# -- jobs ready on busy devices, slot reports (protocol 6) ----------------------

class GpuJob(Leased):
    def __init__(self, id, gpus=1, gpu_memory_mb=None, queued_ms=None):
        super().__init__(id)
        self.gpus, self.gpu_memory_mb, self.queued_ms = gpus, gpu_memory_mb, queued_ms


def opened_gpus(version: int = 6, prefetch: int = 1, devices: int = 2) -> ServerProtocol:
    p = ServerProtocol(max_payload=1 << 16, max_messages_per_second=1000, now=0.0)
    p.receive(json.dumps({"type": "hello", "agent": "a", "kinds": ["embed"], "capacity": 1, "protocol": version,
                          "devices": [{"index": i, "name": "gpu", "memory_mb": 1024} for i in range(devices)],
                          "labels": [], "models": [], "prefetch": prefetch}), 0.0)
    p.accept(Welcome("a#1", 30, 5, 1 << 16))
    p.frames_to_send()
    return p


def test_a_busy_device_takes_one_job_ready_only_for_a_version_6_agent_with_prefetch():
    p = opened_gpus()
    assert p.send_jobs([GpuJob(1), GpuJob(2)]) == []
    assert p.ledger.free_devices() == [] and p.ledger.ready_devices() == [0, 1]
    assert p.send_jobs([GpuJob(3, queued_ms=1500)]) == []
    assert p.ledger.devices_in_use[3] == (0,) and p.ledger.ready_devices() == [1]
    assert [j.id for j in p.send_jobs([GpuJob(4, gpus=2)])] == [4]  # refused: device 0 holds one ready
    assert p.ledger.ready_devices(2048) == []  # too little memory
    jobs = [j for f in sent(p) for j in f["jobs"]]
    assert [(j["id"], j["devices"]) for j in jobs] == [(1, [0]), (2, [1]), (3, [0])]
    assert jobs[2]["queued_ms"] == 1500
    for older in (opened_gpus(version=5), opened_gpus(prefetch=0)):
        older.send_jobs([GpuJob(1), GpuJob(2)])
        assert older.ledger.ready_devices() == []
        assert [j.id for j in older.send_jobs([GpuJob(3, queued_ms=5)])] == [3]  # no free device: refused
        assert all("queued_ms" not in j for f in sent(older) for j in f["jobs"])


def test_a_slot_report_is_summed_over_the_window_and_needs_version_6():
    p = opened_gpus()
    beat = {"type": "heartbeat", "ids": [], "slots": {"busy_ms": 900.0, "idle_ms": 100.0, "gaps": [1] + [0] * 12}}
    [event] = p.receive(json.dumps(beat), 10.0)
    assert event == SlotsReported(SlotReport(900.0, 100.0, (1,) + (0,) * 12))
    assert p.ledger.busy.totals(10.0) == (900.0, 100.0)
    assert p.ledger.busy.totals(71.0) == (0.0, 0.0)  # a minute later it has left the window
    [refused] = opened_gpus(version=5).receive(json.dumps(beat), 0.0)
    assert isinstance(refused, FrameRefused) and refused.code == ErrorCode.UNEXPECTED
    beat["slots"]["gaps"] = [1]
    [bad] = p.receive(json.dumps(beat), 11.0)
    assert isinstance(bad, FrameRefused) and bad.code == ErrorCode.BAD_MESSAGE
