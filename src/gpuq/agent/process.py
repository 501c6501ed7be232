"""``run_process``: a program run from an async handler, stopped when the job is cancelled."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterable
from typing import Any


async def run_process(*argv: str, grace_seconds: float = 10.0, devices: Iterable[int] | None = None,
                      **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    """Run a program from an async handler and wait for it; its output is captured.

    ``devices`` (pass ``job.devices``): the process sees only those GPUs, through
    ``CUDA_VISIBLE_DEVICES`` in its environment, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    so that CUDA numbers them as NVML does (its default puts the fastest first);
    ``env=`` still applies to the rest.
    If the handler is cancelled (``gpuq cancel``, or the agent stopping), the
    process gets SIGTERM, then SIGKILL if it is still there after
    ``grace_seconds``, before the cancellation goes on.
    """
    if devices is not None:
        kwargs["env"] = {**(kwargs.get("env") or os.environ), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                         "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    try:
        out, err = await proc.communicate()
    except asyncio.CancelledError:
        await _stop_process(proc, grace_seconds)
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode or 0, out, err)


async def _stop_process(proc: asyncio.subprocess.Process, grace_seconds: float) -> None:
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.shield(asyncio.wait_for(proc.wait(), grace_seconds))
    except TimeoutError:
        proc.kill()
        await asyncio.shield(proc.wait())
