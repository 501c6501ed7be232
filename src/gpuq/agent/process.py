"""``run_process``: a program run from an async handler, stopped when the job is cancelled."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Iterable
from typing import Any

from gpuq.agent.handlers import current_job
from gpuq.protocol import on_preempt


async def run_process(*argv: str, grace_seconds: float = 10.0, devices: Iterable[int] | None = None,
                      **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    """Run a program from an async handler and wait for it; its output is captured.

    ``devices`` (pass ``job.devices``): the process sees only those GPUs, through
    ``CUDA_VISIBLE_DEVICES`` in its environment, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    so that CUDA numbers them as NVML does (its default puts the fastest first);
    ``env=`` still applies to the rest.
    If the handler is cancelled (``gpuq cancel``, or the agent stopping), the
    process gets SIGTERM, then SIGKILL if it is still there after
    ``grace_seconds``, before the cancellation goes on. If the job is preempted
    (protocol 9), the process gets SIGTERM at once (it may checkpoint and exit;
    the handler then raises, or returns, as it likes) and SIGKILL at the
    preempt's deadline, if still there.
    """
    if devices is not None:
        kwargs["env"] = {**(kwargs.get("env") or os.environ), "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                         "CUDA_VISIBLE_DEVICES": ",".join(map(str, devices))}
    proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    job = current_job.get()
    if job is not None:
        on_preempt(job, lambda: _signal(proc, proc.terminate))
    try:
        out, err = await proc.communicate()
    except asyncio.CancelledError:
        if job is not None and job.preempted:  # its deadline: the SIGTERM was at the preempt
            _signal(proc, proc.kill)
            await asyncio.shield(proc.wait())
        else:
            await _stop_process(proc, grace_seconds)
        raise
    return subprocess.CompletedProcess(list(argv), proc.returncode or 0, out, err)


def _signal(proc: asyncio.subprocess.Process, send: Any) -> None:
    """``send`` (``proc.terminate``, ``proc.kill``) unless the process has ended."""
    if proc.returncode is None:
        try:
            send()
        except ProcessLookupError:
            pass


async def _stop_process(proc: asyncio.subprocess.Process, grace_seconds: float) -> None:
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.shield(asyncio.wait_for(proc.wait(), grace_seconds))
    except TimeoutError:
        proc.kill()
        await asyncio.shield(proc.wait())
