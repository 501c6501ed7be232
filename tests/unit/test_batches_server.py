"""Protocol 7, batches, on the wire and on the server's side: the new fields, the ledger's account
of a batch (one credit, or its devices once) and what ``send_jobs`` refuses. No socket, no database."""

import json

import pytest

from gpuq.protocol import (
    BATCH_SINCE,
    MAX_BATCH_ITEMS,
    PROTOCOL_VERSION,
    Device,
    Done,
    ErrorCode,
    Failed,
    Hello,
    JobMessage,
    Jobs,
    Welcome,
    encode,
    job_message,
    jobs_frame,
    parse_client,
    parse_server,
)
from gpuq.protocol.batches import group
from gpuq.protocol.ledger import Ledger, device_status
from gpuq.protocol.server_side import HelloReceived, JobsReleased, OutcomesReceived, ServerProtocol

TOKEN = "00000000-0000-0000-0000-000000000001"
GPUS = (Device(0, "H100", 81920), Device(1, "H100", 81920))


# -- the wire ---------------------------------------------------------------


@pytest.mark.parametrize("version", [7, 8])
def test_a_hello_from_version_7_on_carries_batch(version):
    assert BATCH_SINCE == 7 and PROTOCOL_VERSION >= 8
    hello = Hello("a", ("embed",), 2, version, batch=64)
    body = json.loads(encode(hello))
    assert body["batch"] == 64 and body["protocol"] == version
    assert parse_client(encode(hello), 1 << 20) == hello


@pytest.mark.parametrize("version", [4, 5, 6])
def test_an_older_hello_has_no_batch_field_and_may_not_carry_one(version):
    hello = Hello("a", ("embed",), 2, version, batch=8)
    body = json.loads(encode(hello))
    assert "batch" not in body
    assert parse_client(encode(hello), 1 << 20).batch == 0
    with pytest.raises(Exception, match="unexpected batch") as err:
        parse_client(json.dumps({**body, "batch": 8}), 1 << 20)
    assert err.value.code == ErrorCode.BAD_MESSAGE and err.value.fatal


@pytest.mark.parametrize("value", [-1, MAX_BATCH_ITEMS + 1, 1.5, True, "8"])
def test_a_hello_batch_out_of_range_is_refused_and_closes(value):
    body = json.loads(encode(Hello("a", ("embed",), 2)))
    with pytest.raises(Exception, match="hello.batch") as err:
        parse_client(json.dumps({**body, "batch": value}), 1 << 20)
    assert err.value.code == ErrorCode.BAD_MESSAGE and err.value.fatal


def test_a_pushed_job_round_trips_its_batch_number():
    frame = jobs_frame([job_message(1, TOKEN, "embed", '{"x":1}', 1, batch=3),
                        job_message(2, TOKEN, "embed", "null", 1, timeout=5, devices=(0,), queued_ms=7, batch=3),
                        job_message(3, TOKEN, "embed", "null", 1)])
    msg = parse_server(frame)
    assert isinstance(msg, Jobs)
    assert [j.batch for j in msg.jobs] == [3, 3, None]
    assert msg.jobs[1] == JobMessage(2, TOKEN, "embed", None, 1, 5.0, (0,), 7, 3)


@pytest.mark.parametrize("value", [0, -2, 1.5, "1", True])
def test_a_pushed_job_with_a_bad_batch_number_is_a_malformed_frame(value):
    frame = json.dumps({"type": "jobs", "jobs": [{"id": 1, "lease_token": TOKEN, "kind": "embed",
                                                  "payload": None, "attempt": 1, "batch": value}]})
    with pytest.raises(Exception, match="job batch must be a positive integer") as err:
        parse_server(frame)
    assert err.value.code == ErrorCode.BAD_MESSAGE


# -- the ledger ------------------------------------------------------------


def ledger(version: int = 7, capacity: int = 2, prefetch: int = 0, batch: int = 4,
           devices: tuple[Device, ...] = ()) -> Ledger:
    led = Ledger()
    led.open(Hello("a", ("embed",), capacity, version, devices, prefetch=prefetch, batch=batch))
    return led


def items(*ids: int) -> list[tuple[int, str]]:
    return [(i, TOKEN) for i in ids]


def test_a_batch_takes_one_credit_until_its_last_outcome():
    led = ledger(capacity=2)
    assert led.hold_batch(items(1, 2, 3), "embed") == ((), 1)
    assert led.free == 1 and set(led.held) == {1, 2, 3}
    assert led.hold_batch(items(4, 5), "embed") == ((), 2)  # numbered per connection
    assert led.free == 0
    _, freed, _ = led.settle([Done(1, TOKEN, None), Failed(2, TOKEN, "x", True)])
    assert freed == 0 and led.free == 0  # item 3 still holds batch 1
    _, freed, _ = led.settle([Done(3, TOKEN, None)])
    assert freed == 1 and led.free == 1 and led.batches == {2: {4, 5}}
    led.settle([Done(4, TOKEN, None), Done(5, TOKEN, None)])
    assert (led.free, led.batches, led.batch_of, led.held) == (2, {}, {}, {})


def test_a_batch_beyond_the_hellos_size_or_to_an_agent_without_batches_is_not_held():
    assert ledger(batch=2).hold_batch(items(1, 2, 3), "embed") is None
    assert ledger(batch=0).hold_batch(items(1), "embed") is None
    led = ledger(version=6, batch=8)  # batches are version 7's
    assert led.batch == 0 and led.hold_batch(items(1), "embed") is None and led.held == {}


def test_a_held_ready_batch_is_one_prefetched_job():
    led = ledger(capacity=1, prefetch=1)
    led.hold_batch(items(1, 2), "embed")
    led.hold_batch(items(3, 4, 5), "embed")
    assert led.free == 0
    assert led.unstarted() == [1, 2, 3, 4, 5]
    led.mark_started([1, 2])
    assert led.release([3, 4, 5]) == tuple(items(3, 4, 5))  # the unstarted batch goes back whole
    assert led.free == 1 and led.batches == {1: {1, 2}}
    assert led.release([1]) == ()  # started: its outcome will come


def test_released_items_free_the_batch_with_the_last_one():
    led = ledger(capacity=1)
    led.hold_batch(items(1, 2), "embed")
    led.release([1])
    assert led.free == 0
    led.release([2])
    assert led.free == 1 and led.batches == {}


def test_a_gpu_batch_takes_its_devices_once_and_frees_them_with_its_last_item():
    led = ledger(devices=GPUS)
    devices, number = led.hold_batch(items(1, 2, 3), "train", gpus=1, min_memory_mb=1024)
    assert devices == (0,) and number == 1
    assert led.free == 2 and led.free_devices() == [1]  # no credit taken
    assert led.devices_in_use == {1: (0,), 2: (0,), 3: (0,)}
    led.settle([Done(1, TOKEN, None), Done(2, TOKEN, None)])
    assert led.free_devices() == [1]
    led.settle([Done(3, TOKEN, None)])
    assert led.free_devices() == [0, 1] and led.devices_in_use == {}


def test_a_busy_device_counts_its_batch_once_and_takes_one_ready_batch():
    led = ledger(prefetch=1, devices=GPUS[:1])
    led.hold_batch(items(1, 2, 3), "train", gpus=1)
    led.mark_started([1, 2, 3])
    assert led.ready_devices() == [0]  # three items, one job running there
    assert led.hold_batch(items(4, 5), "train", gpus=1) == ((0,), 2)
    assert led.ready_devices() == []
    assert device_status(led)[0]["job"] in (1, 2, 3) and device_status(led)[0]["next"] in (4, 5)
    assert led.hold_batch(items(6), "train", gpus=1) is None


# -- ServerProtocol.send_jobs --------------------------------------------


class Leased:
    def __init__(self, id, batch=None, kind="embed", gpus=0, gpu_memory_mb=None):
        self.id, self.lease_token, self.kind, self.payload_json, self.attempt = id, TOKEN, kind, "{}", 1
        self.batch, self.gpus, self.gpu_memory_mb = batch, gpus, gpu_memory_mb


def opened(version: int = 7, batch: int = 4, devices: tuple[Device, ...] = (), capacity: int = 2) -> ServerProtocol:
    p = ServerProtocol(max_payload=1 << 20, max_messages_per_second=1000, now=0.0)
    hello = Hello("a", ("embed", "other"), capacity, version, devices, prefetch=0, batch=batch)
    [event] = p.receive(encode(hello), 0.0)
    assert isinstance(event, HelloReceived)
    p.accept(Welcome("a#1", 30, 5, 1 << 20, version))
    p.frames_to_send()
    return p


def pushed(p: ServerProtocol) -> list[dict]:
    return [j for f in p.frames_to_send() for j in json.loads(f)["jobs"]]


def test_send_jobs_pushes_a_batch_together_numbered_by_the_connection():
    p = opened()
    refused = p.send_jobs([Leased(1, batch="b"), Leased(2), Leased(3, batch="b"), Leased(4, batch=99)])
    assert refused == []
    jobs = pushed(p)
    assert [(j["id"], j.get("batch")) for j in jobs] == [(1, 1), (3, 1), (2, None), (4, 2)]
    assert p.ledger.free == 0 and p.ledger.batches == {1: {1, 3}, 2: {4}}
    [event] = p.receive(encode(Done(1, TOKEN, None)), 0.0)
    assert isinstance(event, OutcomesReceived) and event.freed == 0
    [event] = p.receive(encode(Done(3, TOKEN, None)), 0.0)
    assert event.freed == 1


@pytest.mark.parametrize("version, batch, size", [(6, 4, 1), (7, 0, 1), (7, 2, 3)])
def test_a_batch_the_agent_cannot_take_is_refused_and_nothing_is_held(version, batch, size):
    p = opened(version, batch)
    jobs = [Leased(i, batch=1) for i in range(1, size + 1)]
    assert p.send_jobs([*jobs, Leased(9)]) == jobs
    assert [j["id"] for j in pushed(p)] == [9] and set(p.ledger.held) == {9}


def test_a_batch_of_mixed_kinds_or_gpu_counts_is_refused():
    p = opened(devices=GPUS)
    mixed = [Leased(1, batch=1), Leased(2, batch=1, kind="other")]
    gpus = [Leased(3, batch=2, gpus=1), Leased(4, batch=2)]
    assert p.send_jobs([*mixed, *gpus]) == [*mixed, *gpus]
    assert p.frames_to_send() == [] and p.ledger.held == {}


def test_a_gpu_batch_is_pushed_with_one_set_of_devices_or_refused_whole():
    p = opened(devices=GPUS[:1])
    assert p.send_jobs([Leased(1, batch=1, gpus=1), Leased(2, batch=1, gpus=1, gpu_memory_mb=100)]) == []
    assert [(j["id"], j["devices"], j["batch"]) for j in pushed(p)] == [(1, [0], 1), (2, [0], 1)]
    late = [Leased(3, batch=2, gpus=1), Leased(4, batch=2, gpus=1)]
    assert p.send_jobs(late) == late  # no device left (prefetch 0)


def test_release_of_an_unstarted_batch_gives_back_all_its_items():
    p = opened(capacity=1)
    p.send_jobs([Leased(1, batch=1), Leased(2, batch=1)])
    [event] = p.receive('{"type":"release","ids":[1,2]}', 0.0)
    assert event == JobsReleased(((1, TOKEN), (2, TOKEN))) and p.ledger.free == 1


def test_group_keeps_first_appearance_order():
    a, b, c, d = Leased(1, batch=5), Leased(2), Leased(3, batch=6), Leased(4, batch=5)
    assert group([a, b, c, d]) == [[a, d], [b], [c]]


def test_a_job_leased_again_to_the_same_connection_leaves_no_stale_batch_behind():
    """Its old lease expired while the agent still held it (the sweeper took it back) and a new
    batch brought it again: its old batch must not wait for it forever."""
    led = ledger(capacity=2)
    other = "00000000-0000-0000-0000-000000000002"
    led.hold_batch([(1, TOKEN), (2, TOKEN)], "embed")
    led.hold_batch([(1, other), (3, other)], "embed")  # job 1 again, with a new token
    led.settle([Done(2, TOKEN, None)])  # the old batch's other item: that batch is over
    led.settle([Done(1, other, None), Done(3, other, None)])
    assert (led.batches, led.batch_of, led.held, led.free) == ({}, {}, {}, 2)
