"""GPU placement (issue #16): agents describe their devices, labels and warm models."""

import json

from prometheus_client.parser import text_string_to_metric_families

from gpuq.harness import http_get, running_server
from gpuq.protocol import Device
from tests.helpers import wait_for

H100S = [Device(0, "h100", 81920), Device(1, "h100", 81920)]


async def status(srv) -> dict:
    return json.loads((await http_get(f"{srv.http}/status"))[2])


async def noop(job):
    return None


async def test_an_agent_describes_itself_and_changes_its_models_without_reconnecting(dsn):
    async with running_server(dsn, poll_seconds=60) as srv:
        agent = await srv.agent(["train"], 1, noop, "h100-box", devices=H100S, labels=["gpu=h100", "region=eu"],
                                models=["llama-8b"])
        [me] = (await status(srv))["agents"]
        assert me["protocol"] == 4 and me["labels"] == ["gpu=h100", "region=eu"] and me["models"] == ["llama-8b"]
        assert me["devices"] == [{"index": i, "name": "h100", "memory_mb": 81920, "utilization": None,
                                  "memory_used_mb": None} for i in (0, 1)]
        agent.set_models(["llama-8b", "sdxl"])

        async def updated() -> bool:
            return (await status(srv))["agents"][0]["models"] == ["llama-8b", "sdxl"]

        await wait_for(updated)
        assert (await status(srv))["agents"][0]["agent"] == me["agent"]  # the same connection
        text = (await http_get(f"{srv.http}/metrics"))[2]
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        key = (("agent", me["agent"]), ("device", "1"), ("name", "h100"))
        assert samples[("gpuq_agent_device_memory_total_bytes", key)] == 81920 << 20


async def test_without_devices_given_the_agent_asks_nvml(dsn):
    from gpuq import gpus

    async with running_server(dsn, poll_seconds=60) as srv:
        agent = await srv.agent(["train"], 1, noop, devices=None)
        assert agent.devices == gpus.detect()  # none here: no NVIDIA driver


async def test_device_usage_from_heartbeats_shows_in_status_and_metrics(dsn):
    from gpuq.harness import raw_agent

    async with running_server(dsn, poll_seconds=60) as srv:
        ws, welcome = await raw_agent(srv, protocol=4, labels=[], models=[],
                                      devices=[{"index": 3, "name": "a10", "memory_mb": 24576}])
        await ws.send(json.dumps({"type": "heartbeat", "ids": [],
                                  "devices": [{"index": 3, "utilization": 87, "memory_used_mb": 20000}]}))

        async def reported() -> bool:
            return (await status(srv))["agents"][0]["devices"][0]["utilization"] == 87

        await wait_for(reported)
        assert (await status(srv))["agents"][0]["devices"] == [
            {"index": 3, "name": "a10", "memory_mb": 24576, "utilization": 87, "memory_used_mb": 20000}]
        text = (await http_get(f"{srv.http}/metrics"))[2]
        samples = {(s.name, s.labels.get("device")): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples if "agent" in s.labels}
        assert samples[("gpuq_agent_device_utilization_ratio", "3")] == 0.87
        assert samples[("gpuq_agent_device_memory_used_bytes", "3")] == 20000 << 20
        await ws.close()
