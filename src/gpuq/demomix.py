"""What ``gpuq dev`` runs: a small simulated GPU fleet, and a steady mix of jobs for it.

The fleet (``SPECS``, ``agent_kwargs``): agents with stand-in devices in
``--devices``'s NAME:MEMORY form, labels (``gpu=h100``, ``gpu=a10``) and warm
models, running ``gpuq.demo``'s handlers for every demo kind, batches too.

The mix (``Mix``): streams of jobs, each due at its own pace, the first of each
at once so that the dashboard has something to show in its first seconds:

- ``demo``: plain jobs, and ``embed``: small jobs in bursts that the kind's
  batching policy (``setup``) leases in batches, together at the producer's rate;
- ``infer``: placed 1-GPU jobs with a model (some asking for memory or a label),
  ``train``: 2-GPU jobs now and then and long jobs that report progress;
- the odd failure: a plain job whose first attempt fails (its retry succeeds),
  and an out-of-memory ``infer`` job that fails twice and ends dead.

A GPU stream's pace follows the devices of its pool (the agents with its
label): it keeps ``load`` of them busy on average, so the GPUs stay busy and
no backlog grows, whatever ``--agents`` says. A pool with no agent gets none.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio

from gpuq import admin, demo, queue
from gpuq.gpus import parse_devices
from gpuq.jobs import NewJob

KINDS = ("demo", "embed", "infer", "train")
BATCH_ITEMS = 16  # the embed kind's batches, and each burst of embed jobs
BATCH_WAIT_MS = 100
TICK_SECONDS = 0.1  # how often the producer looks for due jobs
LAG_LIMIT_SECONDS = 5.0  # a producer that fell behind (a suspended laptop) skips what was due before


@dataclass(frozen=True)
class AgentSpec:
    """One demo agent: its devices (``--devices`` form), labels and warm models."""

    name: str
    devices: str
    labels: tuple[str, ...]
    models: tuple[str, ...]

    @property
    def device_count(self) -> int:
        return len(parse_devices(self.devices) or ())


# --agents N takes the first N, round the list again past its end.
SPECS = (
    AgentSpec("h100-box", "sim-h100:80G,sim-h100:80G", ("gpu=h100", "zone=a"), ("llama-8b",)),
    AgentSpec("a10-box", "sim-a10:24G", ("gpu=a10", "zone=a"), ("whisper-small",)),
    AgentSpec("h100-box", "sim-h100:80G,sim-h100:80G", ("gpu=h100", "zone=b"), ("sdxl",)),
)


def fleet(agents: int) -> list[AgentSpec]:
    return [SPECS[i % len(SPECS)] for i in range(agents)]


def agent_kwargs(i: int, capacity: int) -> dict[str, Any]:
    """The ``Agent`` arguments (all but url and token) of demo agent ``i``."""
    spec = SPECS[i % len(SPECS)]
    return {"kinds": list(KINDS), "capacity": capacity, "handler": demo.handle, "name": f"{spec.name}-{i}",
            "devices": parse_devices(spec.devices), "labels": spec.labels, "models": spec.models,
            "batch_handler": demo.handle_batch, "max_batch": BATCH_ITEMS}


async def setup(pool: Any) -> None:
    """The embed kind's batching policy (set again on every start: the same upsert)."""
    await admin.set_batching(pool, "embed", BATCH_ITEMS, max_wait_ms=BATCH_WAIT_MS)


@dataclass
class Stream:
    """Jobs of one shape: ``burst`` of them every ``every`` seconds from 0; ``make(n)`` builds the n-th."""

    every: float
    make: Callable[[int], NewJob]
    burst: int = 1
    sent: int = 0  # bursts sent

    def due(self, elapsed: float) -> list[NewJob]:
        upto = int(elapsed / self.every) + 1
        skipped = upto - max(1, int(LAG_LIMIT_SECONDS / self.every))
        first = max(self.sent, skipped)
        self.sent = max(self.sent, upto)
        return [self.make(n * self.burst + i) for n in range(first, upto) for i in range(self.burst)]


class Mix:
    """The demo's streams for a fleet, at ``rate`` plain and batched jobs a second."""

    def __init__(self, rate: float, job_seconds: float, agents: Sequence[AgentSpec]):
        self.job_seconds = job_seconds
        self.streams: dict[str, Stream] = {}
        if rate > 0:  # 70 % of the rate plain, 30 % batched
            self.streams["plain"] = Stream(1 / (rate * 0.7), self._plain)
            self.streams["embed"] = Stream(BATCH_ITEMS / (rate * 0.3), self._embed, burst=BATCH_ITEMS)
        self.streams["retried"] = Stream(10.0, self._retried)
        h100 = sum(a.device_count for a in agents if "gpu=h100" in a.labels)
        a10 = sum(a.device_count for a in agents if "gpu=a10" in a.labels)
        if h100:  # every H100 box has two: the 2-GPU jobs fit
            self._gpu("infer", 1.25, 1, 0.2, h100, self._infer)
            self._gpu("long", 20.0, 1, 0.4, h100, self._long)
            self._gpu("multi", 6.0, 2, 0.15, h100, self._multi)
            self.streams["dead"] = Stream(30.0, self._out_of_memory)
        if a10:
            self._gpu("transcribe", 1.0, 1, 0.4, a10, self._transcribe)

    def _gpu(self, name: str, seconds: float, gpus: int, load: float, devices: int,
             make: Callable[[int], NewJob]) -> None:
        """A stream of jobs of about ``seconds`` on ``gpus`` each, keeping ``load`` of ``devices`` busy."""
        self.streams[name] = Stream(seconds * gpus / (load * devices), make)

    def due(self, elapsed: float) -> list[NewJob]:
        """The jobs due ``elapsed`` seconds after the start that were not given before."""
        return [job for stream in self.streams.values() for job in stream.due(elapsed)]

    def _plain(self, n: int) -> NewJob:
        return NewJob("demo", {"seconds": self.job_seconds, "n": n})

    def _embed(self, n: int) -> NewJob:
        return NewJob("embed", {"seconds": 0.02, "text": f"sentence {n}"}, cost=16 + n % 48)

    def _retried(self, n: int) -> NewJob:
        return NewJob("demo", {"seconds": 0.5, "fail_attempts": 1, "n": n,
                               "fail": "NCCL watchdog timeout on the first try (simulated; the retry succeeds)"})

    def _infer(self, n: int) -> NewJob:
        payload = {"seconds": 0.5 + 0.5 * (n % 4), "prompt": f"request {n}"}
        if n % 3 == 0:
            return NewJob("infer", payload, gpus=1, model="llama-8b")
        if n % 3 == 1:
            return NewJob("infer", payload, gpus=1, model="llama-8b", gpu_memory_mb=40_000)
        return NewJob("infer", payload, gpus=1, model="sdxl", labels=("gpu=h100",))

    def _transcribe(self, n: int) -> NewJob:
        return NewJob("infer", {"seconds": 0.5 + 0.25 * (n % 4), "audio": f"call-{n}.wav"}, gpus=1,
                      model="whisper-small", labels=("gpu=a10",), gpu_memory_mb=16_000)

    def _long(self, n: int) -> NewJob:
        return NewJob("train", {"seconds": 20.0, "steps": 20, "run": f"finetune-{n}"}, gpus=1,
                      labels=("gpu=h100",), timeout_seconds=120)

    def _multi(self, n: int) -> NewJob:
        return NewJob("train", {"seconds": 6.0, "run": f"shard-{n}"}, gpus=2, labels=("gpu=h100",),
                      gpu_memory_mb=60_000)

    def _out_of_memory(self, n: int) -> NewJob:
        return NewJob("infer", {"seconds": 0.3, "fail": "CUDA out of memory: tried to allocate 20.00 GiB (simulated)",
                                "prompt": f"a very long prompt {n}"},
                      gpus=1, model="llama-8b", labels=("gpu=h100",), max_attempts=2)


class Producer:
    """Enqueues the mix's due jobs every tick, all of them in one INSERT."""

    def __init__(self, pool: Any, mix: Mix):
        self.pool, self.mix = pool, mix
        self.enqueued = 0

    async def step(self, elapsed: float) -> list[NewJob]:
        """Enqueue what is due ``elapsed`` seconds after the start; return it."""
        jobs = self.mix.due(elapsed)
        if jobs:
            await queue.enqueue_many(self.pool, jobs)
            self.enqueued += len(jobs)
        return jobs

    async def run(self, stop: anyio.Event) -> None:
        start = time.monotonic()
        while not stop.is_set():
            await self.step(time.monotonic() - start)
            with anyio.move_on_after(TICK_SECONDS):
                await stop.wait()
