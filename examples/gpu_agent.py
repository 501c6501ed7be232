"""A GPU agent that keeps a model warm on each of its devices and runs one job per device.

    python examples/gpu_agent.py ws://127.0.0.1:8765/agent --token s3cret              # devices from NVML
    python examples/gpu_agent.py ws://127.0.0.1:8765/agent --token s3cret --devices sim:1G,sim:1G

It loads the model onto every device before it connects, then says so in its
hello (``models=["tiny-linear"]``), so the dispatcher sends jobs naming that
model here first. With PyTorch installed the model is a ``torch.nn.Linear`` on
the device's CUDA ordinal (the CPU when CUDA is missing); without it, a
stand-in computes the same layer with numpy, or with plain Python. Each job
takes one device (``--gpus 1``) and runs on the copy loaded there:

    gpuq enqueue embed '{"inputs": [[1, 2, 3, 4]]}' --gpus 1 --model tiny-linear

returns ``{"outputs": [[0.1, 7.4]], "device": 0, "backend": "torch"}``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable
from typing import Any

from gpuq import gpus
from gpuq.agent import Agent, PermanentError
from gpuq.gpus import parse_devices

MODEL = "tiny-linear"
WEIGHTS = [[1.0, 0.0, -1.0, 0.5], [0.25, 0.5, 0.75, 1.0]]  # 4 inputs -> 2 outputs
BIAS = [0.1, -0.1]

Forward = Callable[[list[list[float]]], list[list[float]]]


def load(ordinal: int) -> tuple[Forward, str]:
    """The model on the ``ordinal``-th device this process sees, and the library that runs it."""
    try:
        import torch
    except ImportError:
        return _stand_in()
    where = torch.device(f"cuda:{ordinal}" if torch.cuda.is_available() else "cpu")
    layer = torch.nn.Linear(len(WEIGHTS[0]), len(WEIGHTS)).to(where)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor(WEIGHTS))
        layer.bias.copy_(torch.tensor(BIAS))

    def forward(rows: list[list[float]]) -> list[list[float]]:
        with torch.no_grad():
            return layer(torch.tensor(rows, dtype=torch.float32, device=where)).cpu().tolist()
    return forward, "torch"


def _stand_in() -> tuple[Forward, str]:
    try:
        import numpy as np
    except ImportError:
        return (lambda rows: [[sum(w * x for w, x in zip(ws, row, strict=True)) + b
                               for ws, b in zip(WEIGHTS, BIAS, strict=True)] for row in rows]), "python"
    weights, bias = np.array(WEIGHTS).T, np.array(BIAS)
    return (lambda rows: (np.array(rows, dtype=float) @ weights + bias).tolist()), "numpy"


def handler(models: dict[int, tuple[Forward, str]]) -> Callable[[Any], dict[str, Any]]:
    """A sync handler (the agent runs it in a thread): the job's one device, its copy of the model."""
    def embed(job: Any) -> dict[str, Any]:
        if len(job.devices) != 1:
            raise PermanentError(f"enqueue embed jobs with --gpus 1 (this one got devices {job.devices})")
        rows = job.payload.get("inputs") if isinstance(job.payload, dict) else None
        if not (isinstance(rows, list) and all(isinstance(r, list) and len(r) == len(WEIGHTS[0]) for r in rows)):
            raise PermanentError(f'payload must be {{"inputs": [[{len(WEIGHTS[0])} numbers], ...]}}')
        forward, backend = models[job.devices[0]]
        return {"outputs": [[round(v, 6) for v in out] for out in forward(rows)], "device": job.devices[0],
                "backend": backend}
    return embed


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("url", help="the server's agent endpoint, e.g. ws://127.0.0.1:8765/agent")
    p.add_argument("--token", required=True)
    p.add_argument("--devices", default="auto", help="auto (NVML), or NAME:MEMORY,... (e.g. sim:1G,sim:1G)")
    p.add_argument("--name", default=None)
    a = p.parse_args()
    devices = parse_devices(a.devices)
    devices = gpus.detect() if devices is None else devices
    if not devices:
        p.error("no GPU found through NVML: give --devices NAME:MEMORY,... to run the stand-in")
    # Device indices are NVML's (PCI order); with this, CUDA numbers the devices it sees 0, 1, ...
    # in that order too (by default it puts the fastest first).
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    models = {d.index: load(ordinal) for ordinal, d in enumerate(devices)}
    agent = Agent(a.url, a.token, ["embed"], 1, handler(models), a.name, devices=devices, models=[MODEL])
    await agent.run_until_signal()


if __name__ == "__main__":
    asyncio.run(main())
