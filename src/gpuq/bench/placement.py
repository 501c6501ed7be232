"""``gpuq bench placement``: warm-model placement against a model-blind one, same jobs, same run.

``--serves`` ``gpuq serve`` (default 1) and ``--agents`` agents of ``--devices``
devices each run in this process (``gpuq.harness``); with several serves on
the one database the agents are split between them round-robin, so a job's
warm agent is often another server's (issue #29: placement across servers). ``--models`` models; each agent holds at most
``--warm`` warm (least recently used goes). ``--jobs`` jobs arrive at random
(``--rate`` a second), a mix of 1-, 2- and 4-GPU jobs, each naming a model;
the handler sleeps ``--load-seconds`` when its model is cold on its agent
(then tells the server, ``agent.set_models``), then a random 0.05-0.2 s of
work. The same job sequence runs twice: with ``model=`` (placement prefers a
warm agent) and without (blind: any agent that fits). Every handler checks
the hard rules: ``violations`` counts jobs given the wrong number of devices
or a device another running job held (must be 0).

Figures: ``cold_loads_per_1000`` (and blind), their ratio
``cold_load_ratio`` (issue #16's target: <= 0.25), ``p99_wait_s`` of
multi-GPU jobs (enqueue to handler start), ``jobs_per_s`` (and blind).

``--seeds`` (default 1,2,3,4,5) runs the whole comparison once per job
sequence: each figure is then the median over the seeds, with
``cold_load_ratio_worst`` beside it and every seed's figures under ``seeds``
(issue #30: no figure from one chosen seed).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import time
from collections import OrderedDict
from typing import Any

import anyio

import gpuq
from gpuq.bench import common
from gpuq.bench.measure import percentiles
from gpuq.db import create_pool
from gpuq.harness import running_server
from gpuq.protocol import Device

KIND = "train"
GPU_MIX = (1, 1, 1, 1, 2, 2, 4)  # GPUs per job, drawn uniformly


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        common.positive(p, "--agents", 16, "agents")
        common.positive(p, "--devices", 4, "devices per agent")
        common.positive(p, "--models", 12, "models")
        common.positive(p, "--warm", 2, "warm models per agent")
        common.positive(p, "--jobs", 1000, "jobs per run")
        common.positive(p, "--rate", 250.0, "arrivals a second, at random")
        common.positive(p, "--load-seconds", 0.5, "a cold model's load time")
        common.positive(p, "--serves", 1, "gpuq serve on the one database, the agents split between them")
        p.add_argument("--seeds", type=_seeds, default=(1, 2, 3, 4, 5),
                       help="the job sequences' seeds, comma-separated; figures are medians over them "
                            "(default 1,2,3,4,5)")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        per_seed = []
        for seed in a.seeds:
            common.progress(f"seed {seed}")
            per_seed.append({"seed": seed, **await one_seed(t, a, seed)})
        return summarize(a, per_seed)

    common.declare(sub, "placement", "warm-model GPU placement vs model-blind: cold loads, waits, jobs/s",
                   __doc__, args, body, report,
                   failures=lambda r: [f"{r['violations']} placement violations"] if r["violations"] else [])


def _seeds(text: str) -> tuple[int, ...]:
    try:
        seeds = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not seeds:
        raise argparse.ArgumentTypeError("give at least one seed")
    return seeds


FIGURES = ("cold_loads_per_1000", "blind_cold_loads_per_1000", "cold_load_ratio", "p99_wait_s", "blind_p99_wait_s",
           "jobs_per_s", "blind_jobs_per_s")


def summarize(a: argparse.Namespace, per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure the median over the seeds (the worst ratio beside it), violations summed."""
    out: dict[str, Any] = {"bench": "placement", "serves": a.serves, "agents": a.agents, "devices": a.devices,
                           "models": a.models, "jobs": a.jobs, "load_seconds": a.load_seconds,
                           "violations": sum(s["violations"] for s in per_seed)}
    for key in FIGURES:
        values = [s[key] for s in per_seed if s[key] is not None]
        out[key] = round(common.median(values), 3) if values else None
    ratios = [s["cold_load_ratio"] for s in per_seed if s["cold_load_ratio"] is not None]
    out["cold_load_ratio_worst"] = max(ratios) if ratios else None
    out["seeds"] = per_seed
    return out


async def one_seed(t: common.Target, a: argparse.Namespace, seed: int) -> dict[str, Any]:
    """The comparison on one job sequence: warm-model placement, then model-blind."""
    rng = random.Random(seed)
    jobs = [(min(rng.choice(GPU_MIX), a.devices), f"model-{rng.randrange(a.models)}", rng.uniform(0.05, 0.2),
             rng.expovariate(a.rate)) for _ in range(a.jobs)]
    runs = {}
    for mode in ("placed", "blind"):
        common.progress(f"{mode}: {a.jobs} jobs on {a.agents} agents x {a.devices} devices, {a.serves} serve(s)")
        runs[mode] = await run(t.dsn, a, jobs, warm_preference=mode == "placed")
    placed, blind = runs["placed"], runs["blind"]
    return {"violations": placed["violations"] + blind["violations"],
            "cold_loads_per_1000": placed["cold_per_1000"], "blind_cold_loads_per_1000": blind["cold_per_1000"],
            "cold_load_ratio": round(placed["cold_per_1000"] / blind["cold_per_1000"], 3)
            if blind["cold_per_1000"] else None,
            "p99_wait_s": placed["multi_p99_s"], "blind_p99_wait_s": blind["multi_p99_s"],
            "jobs_per_s": placed["jobs_per_s"], "blind_jobs_per_s": blind["jobs_per_s"]}


class Box:
    """One simulated agent: its warm models (LRU) and the devices its running jobs hold."""

    def __init__(self, warm: int) -> None:
        self.warm: OrderedDict[str, None] = OrderedDict()
        self.capacity = warm
        self.in_use: set[int] = set()
        self.agent: Any = None


async def run(dsn: str, a: argparse.Namespace, jobs: list[tuple[int, str, float, float]],
              warm_preference: bool) -> dict[str, Any]:
    await common.reset_gpuq_schema(dsn)
    counts = {"cold": 0, "violations": 0, "done": 0}
    multi_waits: list[float] = []
    boxes = [Box(a.warm) for _ in range(a.agents)]

    def handler(box: Box):
        async def handle(job: Any) -> None:
            start = time.time()
            gpus, model, work, sent = job.payload["gpus"], job.payload["model"], job.payload["work"], job.payload["t"]
            held = set(job.devices)
            if len(held) != gpus or held & box.in_use:
                counts["violations"] += 1
            box.in_use |= held
            if gpus > 1:
                multi_waits.append(start - sent)
            if model in box.warm:
                box.warm.move_to_end(model)
            else:
                counts["cold"] += 1
                await anyio.sleep(a.load_seconds)
                box.warm[model] = None
                while len(box.warm) > box.capacity:
                    box.warm.popitem(last=False)
                box.agent.set_models(list(box.warm))
            await anyio.sleep(work)
            box.in_use -= held
            counts["done"] += 1
        return handle

    async with await create_pool(dsn, min_size=1, max_size=4) as pool, contextlib.AsyncExitStack() as stack:
        servers = [await stack.enter_async_context(running_server(
            dsn, poll_seconds=1, reserve_after_seconds=2, warm_wait_seconds=a.load_seconds)) for _ in range(a.serves)]
        for i, box in enumerate(boxes):
            box.agent = await servers[i % len(servers)].agent(
                [KIND], 1, handler(box), f"gpu-{i}", devices=[Device(d, "sim", 81920) for d in range(a.devices)])
        began = time.time()
        for gpus, model, work, gap in jobs:
            await anyio.sleep(gap)
            await gpuq.enqueue(pool, KIND, {"gpus": gpus, "model": model, "work": work,
                                                                "t": time.time()},
                               gpus=gpus, model=model if warm_preference else None)
        with anyio.fail_after(600):
            while counts["done"] < len(jobs):
                await anyio.sleep(0.02)
        elapsed = time.time() - began
    waits = percentiles([w * 1000 for w in multi_waits])
    return {"violations": counts["violations"], "cold_per_1000": round(counts["cold"] * 1000 / len(jobs), 1),
            "multi_p99_s": round(waits["p99_ms"] / 1000, 3) if waits else None,
            "jobs_per_s": round(len(jobs) / elapsed, 1)}


def report(r: dict[str, Any]) -> None:
    seeds = r.get("seeds", [])
    common.print_table(["seed", "cold loads / 1000 (blind)", "cold_load_ratio", "multi-GPU p99 wait s (blind)",
                        "jobs/s (blind)", "violations"],
                       [[s["seed"], f"{s['cold_loads_per_1000']} ({s['blind_cold_loads_per_1000']})",
                         s["cold_load_ratio"], f"{s['p99_wait_s']} ({s['blind_p99_wait_s']})",
                         f"{s['jobs_per_s']} ({s['blind_jobs_per_s']})", s["violations"]] for s in seeds],
                       title=f"placement: {r['jobs']} jobs, {r['agents']} agents x {r['devices']} devices "
                             f"over {r.get('serves', 1)} serve(s), "
                             f"{r['models']} models, {r['load_seconds']} s cold load")
    print(f"cold_load_ratio: median {r['cold_load_ratio']}, worst {r['cold_load_ratio_worst']} over "
          f"{len(seeds)} seed(s) (target: median <= 0.25, worst <= 0.3)   violations: {r['violations']}")


if __name__ == "__main__":
    raise SystemExit(common.standalone("placement"))
