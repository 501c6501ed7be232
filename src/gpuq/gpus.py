"""The agent's GPUs: detected through NVML (nvidia-ml-py), or given by hand.

``detect()`` lists the devices NVML sees (none without an NVIDIA driver),
limited to ``CUDA_VISIBLE_DEVICES`` when that is set to indices. ``Usage``
reads each device's utilisation and memory in use for the heartbeats.
``Faults`` reads the Xid and uncorrectable ECC errors the agent reports as device faults
(protocol 9). ``parse_devices`` reads the ``--devices`` flag: ``none``, or a comma list
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


# Xid errors that mean the GPU, not the program, is at fault (NVIDIA's Xid catalogue): ECC
# double-bit and uncontained errors, row-remapping failures, the GPU off the bus, NVLink, GSP
# and micro-controller faults. The others (13, 31, 43, 45, ...) are a program's own bug or its
# end: they quarantine nothing.
HARDWARE_XIDS = frozenset({48, 61, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 136, 140, 143, 154})


class Faults:
    """Reads the Xid and uncorrectable ECC errors of ``devices`` through NVML without blocking:
    ``read()`` lists ``(index, source, error)`` seen since the last read (``xid`` or ``ecc``).
    Without NVML, or where a device cannot report one of them, that part reads nothing."""

    def __init__(self, devices: tuple[Device, ...]):
        self.nvml = _nvml() if devices else None
        self._ecc: dict[int, tuple[Any, int]] = {}  # index -> (handle, uncorrectable errors seen)
        self._events: Any = None  # the NVML event set the Xid errors arrive in
        if self.nvml is not None:
            self._start(self.nvml, [d.index for d in devices])

    def _start(self, nvml: Any, indices: list[int]) -> None:
        handles = {}
        for i in indices:
            try:
                handles[i] = nvml.nvmlDeviceGetHandleByIndex(i)
            except nvml.NVMLError as exc:
                log.warning("gpus.faults_unavailable", device=i, error=str(exc))
        for i, handle in handles.items():
            try:  # ECC off, or a GPU without it: no ECC count to watch
                self._ecc[i] = (handle, self._uncorrectable(handle))
            except nvml.NVMLError:
                pass
        try:
            events = nvml.nvmlEventSetCreate()
        except nvml.NVMLError:
            return
        for handle in handles.values():
            try:
                nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
                self._events = events
            except nvml.NVMLError:  # not supported there (a virtual GPU, say)
                pass

    def _uncorrectable(self, handle: Any) -> int:
        nvml: Any = self.nvml
        return int(nvml.nvmlDeviceGetTotalEccErrors(handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                     nvml.NVML_VOLATILE_ECC))

    def read(self) -> list[tuple[int, str, str]]:
        nvml = self.nvml
        if nvml is None:
            return []
        out = []
        for i, (handle, seen) in list(self._ecc.items()):
            try:
                now = self._uncorrectable(handle)
            except nvml.NVMLError:
                continue
            if now > seen:
                self._ecc[i] = (handle, now)
                out.append((i, "ecc", f"{now - seen} uncorrectable ECC error(s) (volatile count {now})"))
        while self._events is not None:
            try:
                event = nvml.nvmlEventSetWait_v2(self._events, 0)  # 0 ms: only what already arrived
            except nvml.NVMLError:  # a timeout: none waiting
                break
            xid = int(event.eventData)
            if xid in HARDWARE_XIDS:
                try:
                    out.append((int(nvml.nvmlDeviceGetIndex(event.device)), "xid", f"Xid {xid}"))
                except nvml.NVMLError:
                    continue
        return out


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
