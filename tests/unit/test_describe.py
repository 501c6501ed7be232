"""Protocol 4: what an agent says about itself (devices, labels, models, device usage), and --devices."""

import json

import pytest

from gpuq import gpus
from gpuq.protocol import (
    Device,
    DeviceUsage,
    ErrorCode,
    Heartbeat,
    Hello,
    ProtocolError,
    Update,
    encode,
    parse_client,
)
from gpuq.protocol.agent_side import AgentProtocol
from gpuq.protocol.server_side import AgentUpdated, HelloReceived, ServerProtocol

H100 = Device(0, "NVIDIA H100 80GB HBM3", 81559)
HELLO4 = Hello("box", ("train",), 2, 4, (H100, Device(1, "NVIDIA H100 80GB HBM3", 81559)),
               ("gpu=h100", "region=eu"), ("meta-llama/Llama-3-8B",))


def hello_obj(**fields) -> str:
    obj = json.loads(encode(HELLO4))
    obj.update(fields)
    return json.dumps(obj)


def test_a_version_4_hello_round_trips_and_older_ones_carry_nothing_new():
    assert parse_client(encode(HELLO4), 1 << 20) == HELLO4
    old = json.loads(encode(Hello("box", ("train",), 2, 3, (H100,), ("gpu=h100",))))
    assert old.keys() == {"type", "agent", "kinds", "capacity", "protocol"}  # a v3 hello stays v3


@pytest.mark.parametrize("fields, needle", [
    ({"devices": [{"index": 0, "name": "x", "memory_mb": 1}, {"index": 0, "name": "y", "memory_mb": 1}]},
     "distinct indices"),
    ({"devices": [{"index": 0, "name": "", "memory_mb": 1}]}, "hello.devices"),
    ({"devices": [{"index": 0, "name": "x", "memory_mb": -1}]}, "hello.devices"),
    ({"devices": [{"index": 0, "name": "x"}]}, "hello.devices"),
    ({"labels": ["gpu h100"]}, "hello.labels"),
    ({"models": "llama"}, "hello.models"),
])
def test_a_bad_description_refuses_the_hello(fields, needle):
    with pytest.raises(ProtocolError, match=needle) as err:
        parse_client(hello_obj(**fields), 1 << 20)
    assert err.value.fatal


def test_a_version_4_hello_without_its_description_is_refused():
    obj = json.loads(encode(HELLO4))
    del obj["devices"]
    with pytest.raises(ProtocolError, match="missing devices"):
        parse_client(json.dumps(obj), 1 << 20)


def opened(version: int = 4) -> ServerProtocol:
    p = ServerProtocol(max_payload=1 << 16, max_messages_per_second=1000, now=0.0)
    hello = HELLO4 if version == 4 else Hello("box", ("train",), 2, version)
    assert p.receive(encode(hello), 0.0) == [HelloReceived(hello)]
    return p


def test_the_server_keeps_the_latest_labels_models_and_usage():
    p = opened()
    assert (p.labels, p.models) == (("gpu=h100", "region=eu"), ("meta-llama/Llama-3-8B",))
    assert p.receive(encode(Update(None, ("sdxl", "llama-8b"))), 0.0) == [AgentUpdated()]
    assert (p.labels, p.models) == (("gpu=h100", "region=eu"), ("sdxl", "llama-8b"))
    assert p.receive(encode(Update(("gpu=h100",), None)), 0.0) == [AgentUpdated()]
    assert (p.labels, p.models) == (("gpu=h100",), ("sdxl", "llama-8b"))
    usage = (DeviceUsage(0, 35, 1024), DeviceUsage(7, 1, 1))  # 7 is not one of its devices: ignored
    assert p.receive(encode(Heartbeat((), usage)), 0.0) == []
    assert p.ledger.usage == {0: DeviceUsage(0, 35, 1024)}


@pytest.mark.parametrize("frame", [
    encode(Update(("x",), None)),
    encode(Heartbeat((), (DeviceUsage(0, 1, 1),))),
])
def test_version_3_connections_may_not_describe_themselves(frame):
    p = opened(version=3)
    [refused] = p.receive(frame, 0.0)
    assert refused.code == ErrorCode.UNEXPECTED and "protocol 4" in refused.message


@pytest.mark.parametrize("usage", [
    [{"index": 0, "utilization": 101, "memory_used_mb": 1}],
    [{"index": 0, "utilization": 5}],
    "all",
])
def test_bad_usage_is_refused(usage):
    p = opened()
    [refused] = p.receive(json.dumps({"type": "heartbeat", "ids": [], "devices": usage}), 0.0)
    assert refused.code == ErrorCode.BAD_MESSAGE and "heartbeat.devices" in refused.message


def test_the_agent_sends_an_update_and_the_next_hello_carries_it():
    p = AgentProtocol(HELLO4)
    p.connection_made()
    p.frames_to_send()
    p.receive(json.dumps({"type": "welcome", "agent_id": "box#1", "protocol": 4, "lease_seconds": 30,
                          "heartbeat_seconds": 5, "max_payload": 4096}))
    p.update(models=["sdxl"])
    assert [json.loads(f) for f in p.frames_to_send()] == [{"type": "update", "labels": None, "models": ["sdxl"]}]
    with pytest.raises(ProtocolError, match="update.labels"):
        p.update(labels=["no spaces"])
    assert p.hello.labels == HELLO4.labels  # a refused update changes nothing
    p.heartbeat((DeviceUsage(0, 50, 10),))  # usage goes out even with no job running
    assert json.loads(p.frames_to_send()[0])["devices"] == [{"index": 0, "utilization": 50, "memory_used_mb": 10}]
    p.connection_lost()
    p.connection_made()
    assert json.loads(p.frames_to_send()[0])["models"] == ["sdxl"]


def test_devices_flag():
    assert gpus.parse_devices("auto") is None and gpus.parse_devices("none") == ()
    assert gpus.parse_devices("h100:80G, a10:24576") == (Device(0, "h100", 81920), Device(1, "a10", 24576))
    with pytest.raises(ValueError, match="NAME:MEMORY"):
        gpus.parse_devices("h100")


def test_detection_without_an_nvidia_driver_finds_nothing_and_reads_no_usage():
    if gpus._nvml() is not None:
        pytest.skip("this machine has an NVIDIA driver: detection is checked on the device machine")
    assert gpus.detect() == ()
    assert gpus.Usage((H100,)).read() is None


class FakeNVML:
    """NVML's calls that gpus.py makes, for two devices (a real driver is checked on a GPU machine)."""

    class NVMLError(Exception):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA A10" if h else "NVIDIA H100"

    def nvmlDeviceGetMemoryInfo(self, h):
        return type("M", (), {"total": (h + 1) << 34, "used": 3 << 20})()

    def nvmlDeviceGetUtilizationRates(self, h):
        return type("U", (), {"gpu": 40 + h})()


def test_detect_and_usage_read_nvml_within_cuda_visible_devices(monkeypatch):
    monkeypatch.setattr(gpus, "_nvml", FakeNVML)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpus.detect() == (Device(0, "NVIDIA H100", 16384), Device(1, "NVIDIA A10", 32768))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    devices = gpus.detect()
    assert devices == (Device(1, "NVIDIA A10", 32768),)
    assert gpus.Usage(devices).read() == (DeviceUsage(1, 41, 3),)
