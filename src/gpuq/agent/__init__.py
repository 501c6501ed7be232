"""The agent library: run a handler for jobs pushed by a gpuq server.

    import asyncio
    from gpuq.agent import Agent

    async def handle(job):                  # job.id, job.kind, job.payload, job.attempt
        return {"echo": job.payload}        # any JSON value: stored as the job's result

    agent = Agent("ws://127.0.0.1:8765/agent", token="s3cret", kinds=["embed"],
                  capacity=4, handler=handle)
    asyncio.run(agent.run())                # until agent.stop() or SIGTERM (see run_until_signal)

A handler that raises fails the job (retried with backoff); raise
``PermanentError`` for a failure that must not be retried, and ``DeviceError``
when the GPU is bad rather than the job: the agent reports the device, the
server quarantines it after repeated faults, and the job is retried on another
device when one fits. Where NVML is present the agent also reports the Xid and
uncorrectable ECC errors it reads (``gpus.Faults``). Plain (sync)
functions run in a worker thread, so they never block the connection.

Batches (protocol 7): ``Agent(..., batch_handler=embed_many, max_batch=64)``
takes up to 64 jobs in one call, ``embed_many(jobs)`` (async or sync), which
returns one entry per job in order: a result, or an exception instance for
that job alone; raising fails them all. Single jobs go to ``handler``, or,
without one, to the batch handler as a batch of one (``agent.batches``).

Cancelled jobs (``gpuq cancel``): an async handler is cancelled (it sees
``asyncio.CancelledError``; a process it started with ``run_process`` gets
SIGTERM, then SIGKILL after a grace period); a sync handler finds
``job.cancelled`` true and should return early; a job cancelled before its
handler started never runs it. A job with a timeout
(``job.timeout`` seconds) is stopped the same way when it passes, and fails
with ``timeout`` (retried while attempts remain).

Preemption (protocol 9): a job enqueued ``preemptible`` may be asked to yield
(``gpuq preempt``, a higher-priority job, a spot interruption): ``job.preempted``
turns true; the handler may save a checkpoint and stop, by raising (any
exception, or ``JobPreempted``) before ``job.preempt_deadline``
(``time.monotonic()``); ``on_preempt(job, callback)`` calls back at the
preempt (an async handler may set an ``asyncio.Event`` there). At the deadline an async handler is cancelled (a
``run_process`` child got SIGTERM at the preempt, and gets SIGKILL then); a
sync one cannot be, and is waited for. The job goes back to pending without
counting the attempt; a handler that returns a result finished, and its
result is kept.

Progress: ``job.progress(0.4, "epoch 2/5", {"loss": 0.31})`` from any handler,
sync or async, as often as it likes; the agent sends the latest of each job at
most twice a second and the server stores it at most once a second
(``gpuq show``, ``/jobs/ID``, ``gpuq.wait(..., on_progress=...)``).
Checkpoints (protocol 9): ``job.checkpoint({"step": 500, "weights": uri})`` stores small JSON,
fenced by the lease; an attempt that runs the job again gets it as ``job.resume_from``.
``await`` the receipt it returns (``.wait()`` in a sync handler): True once stored. A job's
checkpoints go out at most once per ``checkpoint_seconds`` (the latest; one waiting goes out
before the outcome). ``run_process(..., job=job)`` lets a program do the same.
Outcomes go to the server in ``results`` frames, as many as are ready at
once; they are kept until the server acknowledges them (after its commit)
and sent again after a reconnect; fencing makes a resent result harmless.

Traces (``gpuq[otel]``, protocol 8): a job enqueued while an OpenTelemetry
span was active runs inside a span that continues that trace (``spans``),
current while the handler runs, when the agent's process has a tracer provider.

Modules: ``connection`` (the websocket loop, ``Agent``), ``slots``,
``async_slots``, ``thread_slots`` (running pushed jobs in slots), ``handlers``
(the handler's contract, ``load_handler``), ``process`` (``run_process``),
``spans`` (the handler's span).
``import gpuq.agent`` loads nothing of the database side: agents run on GPU
boxes that need only websockets.
"""

from gpuq.agent.batches import BatchHandler
from gpuq.agent.connection import (
           DEFAULT_MAX_BATCH,
           DEFAULT_PREFETCH,
           PROGRESS_SEND_SECONDS,
           Agent,
           AuthError,
)
from gpuq.agent.handlers import (
           DeviceError,
           Handler,
           HandlerError,
           Job,
           JobPreempted,
           PermanentError,
           load_handler,
)
from gpuq.agent.process import run_process
from gpuq.protocol import on_preempt

__all__ = ["DEFAULT_MAX_BATCH", "DEFAULT_PREFETCH", "PROGRESS_SEND_SECONDS", "Agent", "AuthError", "BatchHandler",
           "DeviceError",
           "Handler", "HandlerError", "Job", "JobPreempted",
           "PermanentError", "load_handler", "on_preempt", "run_process"]
