"""The agent's GPUs: detected through NVML (nvidia-ml-py), or given by hand.

``detect()`` lists the devices NVML sees (none without an NVIDIA driver),
limited to ``CUDA_VISIBLE_DEVICES`` when that is set to indices. ``Usage``
reads each device's utilisation and memory in use for the heartbeats.
``parse_devices`` reads the ``--devices`` flag: ``none``, or a comma list
of ``NAME:MEMORY`` (memory in MiB, or with a ``G``/``M`` suffix), indexed
0, 1, ... in order, for machines without NVML and for tests.
"""

from __future__ import annotations

import os
import re
from typing import Any

from gpuq import logs
from gpuq.protocol import Device, DeviceUsage

log = logs.get("agent")

_DEVICE = re.compile(r"(?P<name>[^:,]{1,128}):(?P<amount>\d+)(?P<unit>[GgMm]?)")


def _nvml() -> Any | None:
    """The initialised ``pynvml`` module, or None when there is no NVIDIA driver (or no binding)."""
    try:
        import pynvml
    except ImportError:  # pragma: no cover - a dependency, but an agent runs without it too
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        log.debug("gpus.nvml_unavailable", error=str(exc))
        return None
    return pynvml


def _visible(count: int) -> list[int]:
    """The NVML indices this process may use: ``CUDA_VISIBLE_DEVICES`` when it lists indices."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is None:
        return list(range(count))
    picked = [int(p) for p in env.split(",") if p.strip().isdigit()]
    return [i for i in picked if i < count]


def detect() -> tuple[Device, ...]:
    """The devices NVML reports (index, name, total memory in MiB); empty without NVML."""
    nvml = _nvml()
    if nvml is None:
        return ()
    devices = []
    for i in _visible(nvml.nvmlDeviceGetCount()):
        handle = nvml.nvmlDeviceGetHandleByIndex(i)
        name = nvml.nvmlDeviceGetName(handle)
        name = name.decode() if isinstance(name, bytes) else str(name)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle).total // (1 << 20)
        devices.append(Device(i, name[:128] or f"gpu{i}", int(memory)))
    return tuple(devices)


class Usage:
    """Reads utilisation and memory in use of ``devices`` through NVML; ``read()`` is None without it."""

    def __init__(self, devices: tuple[Device, ...]):
        self.nvml = _nvml() if devices else None
        self.indices = [d.index for d in devices]

    def read(self) -> tuple[DeviceUsage, ...] | None:
        nvml = self.nvml
        if nvml is None:
            return None
        out = []
        try:
            for i in self.indices:
                handle = nvml.nvmlDeviceGetHandleByIndex(i)
                util = nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                used = nvml.nvmlDeviceGetMemoryInfo(handle).used // (1 << 20)
                out.append(DeviceUsage(i, max(0, min(100, int(util))), int(used)))
        except nvml.NVMLError as exc:  # a device that fell off the bus: report what was read
            log.warning("gpus.usage_failed", error=str(exc))
        return tuple(out)


def parse_devices(text: str) -> tuple[Device, ...] | None:
    """``--devices``: None for ``auto`` (detect), () for ``none``, else ``NAME:MEMORY,...``."""
    text = text.strip()
    if text == "auto":
        return None
    if text in ("", "none"):
        return ()
    devices = []
    for i, part in enumerate(p.strip() for p in text.split(",")):
        m = _DEVICE.fullmatch(part)
        if m is None:
            raise ValueError(f"bad device {part!r}: expected NAME:MEMORY, for example h100:80G or a10:24576")
        amount = int(m["amount"])
        devices.append(Device(i, m["name"], amount * 1024 if m["unit"] in ("G", "g") else amount))
    return tuple(devices)
