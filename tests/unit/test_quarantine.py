"""Quarantine of bad GPUs (issue #33 part 4), the parts without a database: protocol 9's
``device_fault`` on both sides, the ledger and placement leaving quarantined devices out, a
retried job moved off the devices it failed on, DeviceError, and NVML's Xid and ECC errors read
through a fake ``pynvml`` module."""

import json
import sys
import types
from dataclasses import dataclass

import pytest

from gpuq import gpus, placement, quarantine
from gpuq.agent.handlers import DeviceError, report_fault
from gpuq.dispatcher.sessions import AgentSession
from gpuq.jobs import Shape
from gpuq.protocol import (
    Device,
    DeviceFault,
    ErrorCode,
    Hello,
    JobMessage,
    Welcome,
    encode,
    parse_client,
)
from gpuq.protocol.agent_side import AgentProtocol
from gpuq.protocol.ledger import Ledger, device_status
from gpuq.protocol.server_side import DeviceFaulted, FrameRefused, HelloReceived, ServerProtocol

TOKEN = "00000000-0000-0000-0000-000000000000"
H100S = (Device(0, "h100", 81920), Device(1, "h100", 81920))


def fault_frame(**fields) -> str:
    return json.dumps({"type": "device_fault", "devices": [0], "source": "handler", "error": "bad", "job": 7,
                       **fields})


# -- the message ----------------------------------------------------------------


def test_a_device_fault_encodes_and_parses_back():
    msg = DeviceFault((0, 3), "xid", "Xid 79", None)
    assert parse_client(encode(msg), 4096) == msg
    assert parse_client(fault_frame(), 4096) == DeviceFault((0,), "handler", "bad", 7)
    long = parse_client(fault_frame(error="x" * 5000), 1 << 20)
    assert isinstance(long, DeviceFault) and len(long.error) == 1024  # cut, not refused


@pytest.mark.parametrize("fields", [
    {"devices": []}, {"devices": [0, 0]}, {"devices": [256]}, {"devices": ["0"]}, {"devices": [{}]},
    {"source": "cosmic-ray"}, {"error": 5}, {"job": 0}, {"job": "7"},
])
def test_a_malformed_device_fault_is_refused(fields):
    with pytest.raises(Exception) as refused:
        parse_client(fault_frame(**fields), 4096)
    assert refused.value.code == ErrorCode.BAD_MESSAGE


def opened(version: int) -> ServerProtocol:
    p = ServerProtocol(max_payload=4096, max_messages_per_second=1000, now=0.0)
    hello = Hello("box", ("train",), 1, version, devices=H100S if version >= 4 else ())
    [event] = p.receive(encode(hello), 0.0)
    assert isinstance(event, HelloReceived)
    p.accept(Welcome("box#1", 30, 5, 4096, version))
    p.frames_to_send()
    return p


def test_the_server_takes_faults_from_version_9_for_the_hellos_devices_only():
    p = opened(9)
    assert p.receive(fault_frame(devices=[1, 5]), 0.0) == [DeviceFaulted(DeviceFault((1,), "handler", "bad", 7))]
    assert p.receive(fault_frame(devices=[5]), 0.0) == []  # no device the hello named: dropped


def test_a_version_8_connection_may_not_send_a_device_fault():
    p = opened(8)
    [refused] = p.receive(fault_frame(), 0.0)
    assert isinstance(refused, FrameRefused) and refused.code == ErrorCode.UNEXPECTED


def welcome(version: int) -> str:
    return json.dumps({"type": "welcome", "agent_id": "box#1", "protocol": version, "lease_seconds": 30,
                       "heartbeat_seconds": 5, "max_payload": 1 << 20})


def test_the_agent_keeps_faults_until_a_version_9_connection_and_never_sends_them_on_an_older_one():
    p = AgentProtocol(Hello("box", ("train",), 1, devices=H100S))
    p.device_fault((1, 7), "xid", "Xid 79")  # before any connection; device 7 is not the hello's
    p.device_fault((7,), "xid", "Xid 79")  # nothing of the hello's: nothing to send
    p.connection_made()
    p.frames_to_send()
    p.receive(welcome(8))
    assert p.frames_to_send() == []  # a version 8 server would refuse it
    p.connection_lost()
    p.connection_made()
    p.frames_to_send()
    p.receive(welcome(9))
    assert [json.loads(f) for f in p.frames_to_send()] == [
        {"type": "device_fault", "devices": [1], "source": "xid", "error": "Xid 79", "job": None}]
    assert p.frames_to_send() == []


def test_device_error_reports_the_jobs_devices_before_its_outcome():
    p = AgentProtocol(Hello("box", ("train",), 1, devices=H100S))
    p.connection_made()
    p.frames_to_send()
    p.receive(welcome(9))
    job = JobMessage(7, TOKEN, "train", {}, 1, devices=(0, 1))
    report_fault(p, job, DeviceError("CUDA error: an illegal memory access", devices=[1, 4]))
    report_fault(p, job, ValueError("the job's own bug"))  # not a device fault
    p.job_failed(job, "DeviceError: ...", retryable=True)
    frames = [json.loads(f) for f in p.frames_to_send()]
    assert frames[0] == {"type": "device_fault", "devices": [1], "source": "handler",
                         "error": "CUDA error: an illegal memory access", "job": 7}
    assert frames[1]["type"] == "results" and len(frames) == 2
    report_fault(p, JobMessage(8, TOKEN, "train", {}, 1, devices=(0,)), DeviceError())  # default: the job's
    assert json.loads(p.frames_to_send()[0])["devices"] == [0]


# -- the ledger and placement -------------------------------------------------------


def ledger(*devices: Device, prefetch: int = 1) -> Ledger:
    led = Ledger()
    led.open(Hello("box", ("train",), 1, 9, devices=devices, prefetch=prefetch))
    return led


def test_a_quarantined_device_is_neither_free_nor_ready_and_holds_no_new_job():
    led = ledger(*H100S)
    led.quarantined = {0: "xid: Xid 79"}
    assert led.free_devices() == [1] and led.hold(1, TOKEN, "train", gpus=1) == (1,)
    assert led.ready_devices() == [1]  # device 1 may hold one ready; device 0 nothing
    assert led.hold(2, TOKEN, "train", gpus=2) is None
    assert [d["quarantined"] for d in device_status(led)] == [
        "xid: Xid 79", None]


def test_a_job_gets_other_devices_than_those_it_failed_on_when_enough_are_free():
    led = ledger(*H100S, Device(2, "h100", 81920))
    assert led.hold(1, TOKEN, "train", gpus=1, avoid=frozenset({0})) == (1,)
    assert led.hold(2, TOKEN, "train", gpus=2, avoid=frozenset({0, 2})) == (0, 2)  # none other: those


@dataclass
class Agent:
    id: str
    name: str
    kinds: frozenset = frozenset({"train"})
    version: int = 9
    draining: bool = False
    labels: frozenset = frozenset()
    models: frozenset = frozenset()
    devices: tuple = ()
    free: int = 0

    def free_devices(self, min_memory_mb: int = 0) -> list[int]:
        return [d.index for d in self.devices]

    def ready_devices(self, min_memory_mb: int = 0) -> list[int]:
        return []


@dataclass(frozen=True)
class Leased:
    id: int
    leased_by: str
    failed_devices: tuple[str, ...] = ()


def test_elsewhere_moves_a_retried_job_to_an_unused_slot_or_swaps_it_and_else_leaves_it():
    free = {"a#1": [0], "b#1": [0]}
    names = {"a#1": "a", "b#1": "b"}
    retried = Leased(1, "a#1", ("a:0",))
    assert placement.elsewhere([retried], ["a#1", "b#1"], free, names, 1) == {1: "b#1"}
    fresh = Leased(2, "b#1")
    assert placement.elsewhere([retried, fresh], ["a#1", "b#1"], free, names, 1) == {1: "b#1", 2: "a#1"}
    assert placement.elsewhere([retried], ["a#1"], free, names, 1) == {}  # nowhere else: back there
    assert placement.elsewhere([Leased(1, "a#1", ("b:0",))], ["a#1", "b#1"], free, names, 1) == {}


def test_a_sessions_devices_leave_out_the_quarantined_ones_so_placement_cannot_count_them():
    p = opened(9)
    session = AgentSession(p, flush=lambda: None, id="box#1")
    p.ledger.quarantined = {1: "3 device faults"}
    assert session.devices == (H100S[0],) and session.free_devices() == [0]
    two = Shape("train", "d", 2, None, frozenset(), None, False)
    assert not placement.could_run(two, session)


def test_a_device_is_named_agent_colon_index():
    assert quarantine.parse_device("gpu-box-1:3") == ("gpu-box-1", 3)
    assert quarantine.parse_device("host:8765:0") == ("host:8765", 0)  # a name may hold a colon
    assert quarantine.parse_device("gpu-box-1") == ("gpu-box-1", None)
    with pytest.raises(ValueError):
        quarantine.parse_device("no spaces:1")


# -- NVML: a fake pynvml where gpus.py imports it -------------------------------------


class NVMLError(Exception):
    pass


def fake_nvml(ecc: dict[int, int], events: list[tuple[int, int]], ecc_supported: bool = True,
              events_supported: bool = True) -> types.ModuleType:
    """A stand-in for nvidia-ml-py: devices by handle ``h<i>``, a mutable ECC count per device, and
    Xid events ``(index, xid)`` waiting in the event set."""
    m = types.ModuleType("pynvml")
    m.NVMLError = NVMLError
    m.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, m.NVML_VOLATILE_ECC, m.nvmlEventTypeXidCriticalError = 1, 0, 8
    m.nvmlInit = lambda: None
    m.nvmlDeviceGetHandleByIndex = lambda i: f"h{i}"
    m.nvmlDeviceGetIndex = lambda handle: int(handle[1:])

    def total_ecc(handle, error_type, counter):
        assert (error_type, counter) == (1, 0)
        if not ecc_supported:
            raise NVMLError("Not Supported")
        return ecc[int(handle[1:])]

    def register(handle, types_, event_set):
        assert types_ == 8 and event_set == "set"
        if not events_supported:
            raise NVMLError("Not Supported")

    def wait(event_set, timeout_ms):
        assert timeout_ms == 0  # never blocks the agent
        if not events:
            raise NVMLError("Timeout")
        index, xid = events.pop(0)
        return types.SimpleNamespace(device=f"h{index}", eventData=xid, eventType=8)

    m.nvmlDeviceGetTotalEccErrors, m.nvmlDeviceRegisterEvents, m.nvmlEventSetWait_v2 = total_ecc, register, wait
    m.nvmlEventSetCreate = lambda: "set"
    return m


def test_faults_reads_new_uncorrectable_ecc_errors_and_hardware_xids(monkeypatch):
    ecc = {0: 2, 1: 0}
    events: list[tuple[int, int]] = []
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(ecc, events))
    faults = gpus.Faults(H100S)
    assert faults.read() == []  # the counts at start are the baseline
    ecc[0] = 3
    events += [(1, 79), (0, 13), (1, 48)]  # 13: a program's own fault, not the GPU's
    assert faults.read() == [(0, "ecc", "1 uncorrectable ECC error(s) (volatile count 3)"),
                             (1, "xid", "Xid 79"), (1, "xid", "Xid 48")]
    assert faults.read() == []


def test_faults_reads_nothing_quietly_where_nvml_cannot_report_them(monkeypatch):
    events = [(0, 79)]
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml({0: 0}, events, ecc_supported=False,
                                                          events_supported=False))
    assert gpus.Faults(H100S[:1]).read() == []
    assert gpus.Faults(()).read() == []  # no devices: NVML is not even asked


# -- DeviceError through the agent's own slots (gpuq.testing) ---------------------------


async def test_a_device_error_from_a_sync_an_async_or_a_batch_handler_reports_the_devices_once():
    from gpuq.testing import LocalAgent

    def sync(job):
        raise DeviceError("Xid 79 seen by the handler", devices=[1])

    async def batch(jobs):
        return [DeviceError("ECC") for _ in jobs]  # one per item: one fault for the batch

    async with LocalAgent(sync, devices=2) as agent:
        outcome = await agent.run(devices=(0, 1))
        assert outcome.failed and not outcome.permanent and "DeviceError" in outcome.error
    assert [(f.devices, f.source, f.error, f.job) for f in agent.faults] == [
        ((1,), "handler", "Xid 79 seen by the handler", 1)]
    async with LocalAgent(batch_handler=batch, devices=1) as agent:
        outcomes = await agent.run_batch([{}, {}, {}], devices=(0,))
        assert all(o.failed for o in outcomes)
    assert [f.devices for f in agent.faults] == [(0,)]
