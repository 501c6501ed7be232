"""What an agent says about itself (protocol 4): devices, labels, warm models, device usage.

Types and strict checks only (``parse`` builds ``hello``, ``update`` and
``heartbeat`` from them, ``frames`` encodes them). A device is one GPU the agent may
give to jobs: its ``index`` is what the handler gets in ``job.devices`` (and
what ``CUDA_VISIBLE_DEVICES`` names). Labels are free-form ``key=value`` (or
bare) words a job can require; models are the names of the models the agent
holds warm, which a job can prefer.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from gpuq.protocol.codes import ErrorCode, ProtocolError

__all__ = ["LABEL_RULE", "MAX_DEVICES", "MAX_LABELS", "MAX_MODELS", "MODEL_RULE", "Device", "DeviceUsage",
           "check_labels", "check_models", "device_json", "devices_from", "is_label", "is_model",
           "usage_from", "usage_json"]

MAX_DEVICES = 64
MAX_LABELS = 64
MAX_MODELS = 256
MAX_DEVICE_INDEX = 255
MAX_MEMORY_MB = 2**31 - 1  # 2 PiB: more is a typo, not a GPU
_LABEL = re.compile(r"[A-Za-z0-9_.:/=@+-]{1,128}")
_MODEL = re.compile(r"[A-Za-z0-9_.:/=@+-]{1,256}")
LABEL_RULE = "1-128 characters of A-Z a-z 0-9 _ . : / = @ + - (for example gpu=h100)"
MODEL_RULE = "1-256 characters of A-Z a-z 0-9 _ . : / = @ + - (for example meta-llama/Llama-3-8B)"
BAD = ErrorCode.BAD_MESSAGE


@dataclass(frozen=True, slots=True)
class Device:
    """One GPU an agent offers: ``index`` (its CUDA index), ``name``, total memory in MiB."""

    index: int
    name: str
    memory_mb: int


@dataclass(frozen=True, slots=True)
class DeviceUsage:
    """A device's load at one heartbeat (NVML): utilisation in percent, memory in use in MiB."""

    index: int
    utilization: int
    memory_used_mb: int


def is_label(value: Any) -> bool:
    return isinstance(value, str) and _LABEL.fullmatch(value) is not None


def is_model(value: Any) -> bool:
    return isinstance(value, str) and _MODEL.fullmatch(value) is not None


def check_labels(value: Any, where: str, fatal: bool = False) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_LABELS or not all(map(is_label, value)):
        raise ProtocolError(BAD, f"{where} must be a list of at most {MAX_LABELS} labels ({LABEL_RULE})",
                            fatal=fatal)
    return tuple(dict.fromkeys(value))


def check_models(value: Any, where: str, fatal: bool = False) -> tuple[str, ...]:
    if not isinstance(value, list | tuple) or len(value) > MAX_MODELS or not all(map(is_model, value)):
        raise ProtocolError(BAD, f"{where} must be a list of at most {MAX_MODELS} model names ({MODEL_RULE})",
                            fatal=fatal)
    return tuple(dict.fromkeys(value))


def devices_from(value: Any, fatal: bool = True) -> tuple[Device, ...]:
    """``hello.devices``: a list of ``{index, name, memory_mb}`` with distinct indices."""
    rule = (f"hello.devices must be a list of at most {MAX_DEVICES} objects {{index, name, memory_mb}} "
            f"with distinct indices 0-{MAX_DEVICE_INDEX}, names of 1-128 characters and memory in MiB")
    if not isinstance(value, list) or len(value) > MAX_DEVICES:
        raise ProtocolError(BAD, rule, fatal=fatal)
    out = []
    for d in value:
        if (not isinstance(d, dict) or d.keys() != {"index", "name", "memory_mb"}
                or not _int_in(d["index"], 0, MAX_DEVICE_INDEX) or not _int_in(d["memory_mb"], 0, MAX_MEMORY_MB)
                or not isinstance(d["name"], str) or not 1 <= len(d["name"]) <= 128):
            raise ProtocolError(BAD, rule, fatal=fatal)
        out.append(Device(d["index"], d["name"], d["memory_mb"]))
    if len({d.index for d in out}) < len(out):
        raise ProtocolError(BAD, rule, fatal=fatal)
    return tuple(out)


def usage_from(value: Any) -> tuple[DeviceUsage, ...]:
    """``heartbeat.devices``: ``{index, utilization, memory_used_mb}`` per device."""
    rule = (f"heartbeat.devices must be a list of at most {MAX_DEVICES} objects "
            "{index, utilization (0-100), memory_used_mb}")
    if not isinstance(value, list) or len(value) > MAX_DEVICES:
        raise ProtocolError(BAD, rule)
    out = []
    for d in value:
        if (not isinstance(d, dict) or d.keys() != {"index", "utilization", "memory_used_mb"}
                or not _int_in(d["index"], 0, MAX_DEVICE_INDEX) or not _int_in(d["utilization"], 0, 100)
                or not _int_in(d["memory_used_mb"], 0, MAX_MEMORY_MB)):
            raise ProtocolError(BAD, rule)
        out.append(DeviceUsage(d["index"], d["utilization"], d["memory_used_mb"]))
    return tuple(out)


def device_json(d: Device) -> dict[str, Any]:
    return {"index": d.index, "name": d.name, "memory_mb": d.memory_mb}


def usage_json(u: DeviceUsage) -> dict[str, Any]:
    return {"index": u.index, "utilization": u.utilization, "memory_used_mb": u.memory_used_mb}


def _int_in(value: Any, low: int, high: int) -> bool:
    return type(value) is int and low <= value <= high
