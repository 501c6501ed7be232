"""``run_process``: a program run from an async handler, stopped when the job is cancelled; with
``job=``, the program resumes from the job's checkpoint and makes its own (``resume_from`` and
``checkpoint`` here, called in the program, or the same by hand in any language)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from gpuq import logs
from gpuq.agent.handlers import current_job
from gpuq.protocol import on_preempt

if TYPE_CHECKING:
    from gpuq.protocol import JobMessage

log = logs.get("agent")

# What a program run with ``run_process(..., job=job)`` finds in its environment: the job's
# checkpoint to resume from (JSON; unset when it has none), and the file descriptor it writes its
# checkpoints to, one JSON value per line.
RESUME_FROM_ENV = "GPUQ_RESUME_FROM"
CHECKPOINT_FD_ENV = "GPUQ_CHECKPOINT_FD"

async def run_process(*argv: str, grace_seconds: float = 10.0, devices: Iterable[int] | None = None,
                      job: JobMessage | None = None, **kwargs: Any) -> subprocess.CompletedProcess[bytes]:
    """Run a program from an async handler and wait for it; its output is captured.

    ``devices`` (pass ``job.devices``): the process sees only those GPUs, through
    ``CUDA_VISIBLE_DEVICES`` in its environment, with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    so that CUDA numbers them as NVML does (its default puts the fastest first);
    ``env=`` still applies to the rest.
    ``job`` (pass the handler's): the process gets ``job.resume_from`` as JSON in
    ``GPUQ_RESUME_FROM`` (unset when there is none), and each line of JSON it writes to the
    file descriptor named by ``GPUQ_CHECKPOINT_FD`` becomes a ``job.checkpoint()`` (all of
    them before this returns, so before the job's outcome); a line that is not a valid
    checkpoint is logged and skipped. In Python: ``resume_from()`` and ``checkpoint(data)``.
    If the handler is cancelled (``gpuq cancel``, or the agent stopping), the
    process gets SIGTERM, then SIGKILL if it is still there after
    ``grace_seconds``, before the cancellation goes on. If the job is preempted
    (protocol 9), the process gets SIGTERM at once (it may checkpoint and exit;
    the handler then raises, or returns, as it likes) and SIGKILL at the
    preempt's deadline, if still there.
    """
    env = dict(kwargs.get("env") or os.environ)
    if devices is not None:
        env.update(CUDA_DEVICE_ORDER="PCI_BUS_ID", CUDA_VISIBLE_DEVICES=",".join(map(str, devices)))
    read_fd = write_fd = None
    if job is not None:
        env.pop(RESUME_FROM_ENV, None)
        if job.resume_from is not None:
            env[RESUME_FROM_ENV] = json.dumps(job.resume_from, separators=(",", ":"))
        read_fd, write_fd = os.pipe()
        env[CHECKPOINT_FD_ENV] = str(write_fd)
        kwargs["pass_fds"] = (*kwargs.get("pass_fds", ()), write_fd)
    if devices is not None or job is not None:
        kwargs["env"] = env
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)
    except BaseException:
        if read_fd is not None:
            os.close(read_fd)
        raise
    finally:
        if write_fd is not None:
            os.close(write_fd)  # the child's copy stays open until it exits: then the reader ends
    relay = None if job is None or read_fd is None else asyncio.create_task(_relay_checkpoints(read_fd, job))
    yielding = job or current_job.get()  # preempted: SIGTERM now, SIGKILL at the deadline
    if yielding is not None:
        on_preempt(yielding, lambda: _signal(proc, proc.terminate))
    try:
        out, err = await proc.communicate()
        if relay is not None:
            await relay
    except asyncio.CancelledError:
        if relay is not None:
            relay.cancel()
        if yielding is not None and yielding.preempted:  # its deadline: the SIGTERM was at the preempt
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


async def _relay_checkpoints(read_fd: int, job: JobMessage) -> None:
    """Each line the process writes is a checkpoint of ``job``, until it closes its end."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 20)
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                os.fdopen(read_fd, "rb", buffering=0))
    try:
        while line := await reader.readline():
            try:
                job.checkpoint(json.loads(line))
            except ValueError as exc:  # not JSON, or not a checkpoint (None, too large)
                log.warning("process.bad_checkpoint", job_id=job.id, error=str(exc)[:200])
    finally:
        transport.close()


async def _stop_process(proc: asyncio.subprocess.Process, grace_seconds: float) -> None:
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.shield(asyncio.wait_for(proc.wait(), grace_seconds))
    except TimeoutError:
        proc.kill()
        await asyncio.shield(proc.wait())


# -- in the program run_process(..., job=job) started ----------------------------


def resume_from() -> Any:
    """The job's checkpoint to resume from (``GPUQ_RESUME_FROM``), or None when it has none."""
    text = os.environ.get(RESUME_FROM_ENV)
    return None if text is None else json.loads(text)


def checkpoint(data: Any) -> None:
    """Hand ``data`` to the agent as the job's checkpoint (one line on ``GPUQ_CHECKPOINT_FD``);
    ``RuntimeError`` when this program was not started by ``run_process(..., job=job)``."""
    fd = os.environ.get(CHECKPOINT_FD_ENV)
    if fd is None:
        raise RuntimeError(f"no {CHECKPOINT_FD_ENV}: start this program with run_process(..., job=job)")
    line = (json.dumps(data, separators=(",", ":"), allow_nan=False) + "\n").encode()
    view = memoryview(line)
    while view:
        view = view[os.write(int(fd), view):]
