"""``gpuq bench batching``: small jobs batched into one handler call against one call per job, same agents.

``gpuq serve`` and ``--agents`` agents of ``--capacity`` slots run as processes
(``harness.Fleet``), each agent with one batch handler
(``gpuq.bench.handlers:batch_sleep``) that sleeps ``--fixed-ms`` + ``--per-item-ms``
per item (a GPU forward pass: a fixed cost and a small one per item); the
unbatched runs give it single jobs. Each job carries a random ``cost``: 1-64
(a short text's tokens), and for 1 % of them 4,096-12,288 (a long one: some
over the ``--max-cost`` budget alone, which run alone). The budget binds on
the batches with a long item; the others fill to ``--max-items``
(``batched_mean_items``: the batch size the batched run got).

- Closed loop: ``--jobs`` queued jobs at ``--max-items`` a batch, then
  ``--unbatched-jobs`` with no policy (one call per job): ``batched_jobs_per_s``,
  ``unbatched_jobs_per_s``, their ``speedup``; ``ideal_jobs_per_s`` (every slot
  always running a full batch) and ``ideal_fraction``; the dispatcher's own
  ceiling for these jobs, the same batched run (same costs, poison, cancels)
  with a handler that returns at once (``ceiling_jobs_per_s``,
  ``ceiling_fraction``: batched over the lower of the two), and its best case,
  full batches of one-field jobs (``noop_jobs_per_s``). In the batched run 1 % of the items are poison (their entry is an
  exception: ``poison_extra_attempts`` counts extra attempts of the good items,
  must be 0), 1 % are cancelled while queued (``cancelled_ran``: how many of
  them were still leased, must be 0), and ``cost_violations`` counts batches
  (as recorded on the jobs) whose costs sum over the budget (must be 0).
- Open loop: Poisson arrivals at each of ``--rates`` for ``--open-jobs`` jobs,
  batched with ``--max-wait-ms`` and unbatched: p50/p99 of enqueue to done
  (``open_loop``), from the database's own timestamps.

``lost``: good jobs (neither poison nor cancelled) of the batched run not done (must be 0).
"""

from __future__ import annotations

import argparse
import math
import random
import time
from collections.abc import Callable
from typing import Any

import anyio

from gpuq import admin, producer
from gpuq.bench import common
from gpuq.bench.measure import CpuMeter, postmaster_pid
from gpuq.harness import Fleet
from gpuq.jobs import NewJob

KIND = "bench-batch"
CHUNK = 5000  # jobs per enqueue statement
HANDLER = "gpuq.bench.handlers:batch_sleep"


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        common.positive(p, "--agents", 4, "agents")
        common.positive(p, "--capacity", 4, "slots per agent")
        common.positive(p, "--jobs", 100_000, "queued jobs of the batched closed loop (and of its ceiling run)")
        common.positive(p, "--unbatched-jobs", 2_000, "queued jobs of the unbatched closed loop")
        common.positive(p, "--max-items", 64, "jobs a batch at most")
        common.positive(p, "--max-cost", 8192, "a batch's cost budget (job costs are 1-64, 1 %% 4096-12288)")
        common.positive(p, "--max-wait-ms", 10, "the open loop's wait for a partial batch")
        common.positive(p, "--fixed-ms", 20.0, "the handler's cost per call")
        common.positive(p, "--per-item-ms", 0.2, "the handler's cost per item")
        common.positive(p, "--open-jobs", 60, "jobs per open-loop rate and mode")
        p.add_argument("--rates", type=_rates, default=(2.0, 20.0, 200.0),
                       help="open-loop arrival rates, jobs/s, comma-separated (default 2,20,200)")

    common.declare(sub, "batching", "small jobs batched into one handler call vs one call per job",
                   __doc__, args, body, report, failures=failures)


def _rates(text: str) -> tuple[float, ...]:
    try:
        rates = tuple(float(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None
    if not rates or min(rates) <= 0:
        raise argparse.ArgumentTypeError("give at least one positive rate")
    return rates


async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"bench": "batching", "agents": a.agents, "capacity": a.capacity, "max_items": a.max_items}
    async with common.fleet_on(t.dsn) as (fleet, conn, _):
        common.progress(f"starting gpuq serve on 127.0.0.1:{fleet.port} and {a.agents} agents "
                        f"(capacity {a.capacity}, batches of up to {a.max_items}); logs in {fleet.logdir}")
        await anyio.to_thread.run_sync(fleet.start_serve)
        await anyio.to_thread.run_sync(lambda: fleet.start_agents(a.agents, a.capacity, None, kinds=KIND,
                                                                  batch_handler=HANDLER, max_batch=a.max_items))
        pg_pid = await postmaster_pid(conn)
        meter = lambda: CpuMeter({**fleet.pids(), "postgres": [pg_pid] if pg_pid else []})  # noqa: E731
        out.update(await closed_loop(conn, fleet, a, meter))
        out["open_loop"] = {f"{rate:g}": await open_loop(conn, fleet, a, rate) for rate in a.rates}
    slots = a.agents * a.capacity
    out["ideal_jobs_per_s"] = round(slots * a.max_items / ((a.fixed_ms + a.per_item_ms * a.max_items) / 1000), 1)
    out["ideal_fraction"] = round(out["batched_jobs_per_s"] / out["ideal_jobs_per_s"], 3)
    out["ceiling_fraction"] = round(out["batched_jobs_per_s"] / min(out["ideal_jobs_per_s"],
                                                                    out["ceiling_jobs_per_s"]), 3)
    out["speedup"] = round(out["batched_jobs_per_s"] / out["unbatched_jobs_per_s"], 1)
    return out


async def closed_loop(conn: Any, fleet: Fleet, a: argparse.Namespace, meter: Callable[[], CpuMeter]) -> dict[str, Any]:
    """The batched run (poison, cancels, costs), its no-op ceiling, then the unbatched run; CPU
    microseconds per job of each component in the batched and ceiling runs (``cpu_us_per_job``)."""
    await admin.set_batching(conn, KIND, a.max_items, max_cost=a.max_cost)
    common.progress(f"closed loop, batched: {a.jobs:,} jobs at {a.max_items} a batch")
    rng = random.Random(1)
    cost = {"fixed_ms": a.fixed_ms, "per_item_ms": a.per_item_ms}
    costs = [rng.randint(4096, 12288) if i % 100 == 25 else rng.randint(1, 64) for i in range(a.jobs)]
    specs = [{"cost": c, "poison": i % 100 == 50, **cost} for i, c in enumerate(costs)]
    cpu = meter()
    ids, seconds, cancelled = await _run_queued(conn, fleet, specs, cancel_every=100, cpu=cpu)
    good = [i for i, s in zip(ids, specs, strict=True) if not s["poison"] and i not in cancelled]
    extra = await conn.fetchval("SELECT coalesce(sum(attempts - 1), 0) FROM gpuq.jobs WHERE id = ANY($1)", good)
    done = await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE id = ANY($1) AND status = 'done'", good)
    ran = await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE id = ANY($1) AND attempts > 0", list(cancelled))
    over = await conn.fetchval("SELECT count(*) FROM (SELECT batch_id FROM gpuq.jobs WHERE id = ANY($1) AND batch_size > 1 "
                               "GROUP BY batch_id HAVING sum(cost) > $2) b", ids, a.max_cost)
    items = await conn.fetchval("SELECT avg(batch_size) FROM gpuq.jobs WHERE id = ANY($1) AND batch_size IS NOT NULL", ids)
    out = {"batched_jobs_per_s": round((len(ids) - len(cancelled)) / seconds, 1),
           "batched_mean_items": round(float(items or 0), 1),
           "poison_extra_attempts": int(extra), "cancelled_ran": ran, "cost_violations": over,
           "lost": len(good) - done}  # a good job not done: lost
    out["cpu_us_per_job"] = {"batched": _per_job(cpu, len(ids) - len(cancelled))}
    common.progress(f"closed loop, batched, no-op handler (the dispatcher's ceiling): {a.jobs:,} jobs")
    cpu = meter()
    free = {"fixed_ms": 0, "per_item_ms": 0}  # the same payloads' size, no sleep
    ids, seconds, cancelled = await _run_queued(conn, fleet, [{**s, **free} for s in specs], cancel_every=100, cpu=cpu)
    out["ceiling_jobs_per_s"] = round((len(ids) - len(cancelled)) / seconds, 1)
    out["cpu_us_per_job"]["ceiling"] = _per_job(cpu, len(ids) - len(cancelled))
    common.progress(f"closed loop, batched, no-op handler, full batches of one-field jobs: {a.jobs:,} jobs")
    ids, seconds, _ = await _run_queued(conn, fleet, [{"cost": 1}] * a.jobs)
    out["noop_jobs_per_s"] = round(len(ids) / seconds, 1)
    await admin.set_batching(conn, KIND, None)
    common.progress(f"closed loop, unbatched: {a.unbatched_jobs:,} jobs, one call each")
    ids, seconds, _ = await _run_queued(conn, fleet, [{"cost": 1, **cost}] * a.unbatched_jobs)
    out["unbatched_jobs_per_s"] = round(len(ids) / seconds, 1)
    return out


def _per_job(cpu: CpuMeter, jobs: int) -> dict[str, float | None]:
    return {k: None if v is None else round(v / jobs * 1e6, 1) for k, v in cpu.used.items()}


async def _run_queued(conn: Any, fleet: Fleet, specs: list[dict[str, Any]], cancel_every: int = 0,
                      cpu: CpuMeter | None = None) -> tuple[list[int], float, set[int]]:
    """Queue the jobs while the kind is paused (cancelling every ``cancel_every``-th), resume it, and
    wait until none is live: ids, seconds from the resume to the last end, the cancelled ids.
    A cancelled job never leased has no attempt: ``cancelled_ran`` counts those with one."""
    await admin.pause(conn, KIND, by="bench")
    ids: list[int] = []
    for lo in range(0, len(specs), CHUNK):
        ids += await producer.enqueue_many(conn, [NewJob(KIND, s, max_attempts=1, cost=s["cost"])
                                                    for s in specs[lo:lo + CHUNK]])
    cancelled = set((await admin.cancel(conn, *ids[cancel_every // 2::cancel_every])) if cancel_every else ())
    began = time.monotonic()
    if cpu is not None:
        cpu.start()
    await admin.resume(conn, KIND)
    await _drained(conn, fleet, ids, timeout=max(120.0, len(ids) / 100))
    if cpu is not None:
        cpu.stop()
    return ids, time.monotonic() - began, cancelled


async def open_loop(conn: Any, fleet: Fleet, a: argparse.Namespace, rate: float) -> dict[str, Any]:
    """Poisson arrivals at ``rate``, batched (``max_wait_ms``) then unbatched: enqueue -> done p50/p99."""
    out: dict[str, Any] = {}
    cost = {"cost": 1, "fixed_ms": a.fixed_ms, "per_item_ms": a.per_item_ms}
    for mode, items in (("batched", a.max_items), ("unbatched", None)):
        await admin.set_batching(conn, KIND, items, max_wait_ms=a.max_wait_ms)
        common.progress(f"open loop, {mode}: {a.open_jobs} jobs at {rate:g}/s")
        rng = random.Random(2)
        ids = []
        for _ in range(a.open_jobs):
            await anyio.sleep(rng.expovariate(rate))
            ids.append(await producer.enqueue(conn, KIND, cost, cost=1))
        await _drained(conn, fleet, ids, timeout=120)
        ms = await conn.fetch("SELECT extract(epoch FROM finished_at - created_at) * 1000 AS ms FROM gpuq.jobs "
                              "WHERE id = ANY($1) ORDER BY 1", ids)
        xs = [float(r["ms"]) for r in ms]
        out[mode] = {"p50_ms": round(_pct(xs, 50), 2), "p99_ms": round(_pct(xs, 99), 2)}
    return out


def _pct(sorted_xs: list[float], p: float) -> float:
    return sorted_xs[min(len(sorted_xs) - 1, math.ceil(p / 100 * len(sorted_xs)) - 1)]


async def _drained(conn: Any, fleet: Fleet, ids: list[int], timeout: float) -> None:
    async def empty() -> bool:
        return not await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE id = ANY($1) AND status IN "
                                       "('pending', 'leased', 'scheduled')", ids)

    await common.wait_until(empty, fleet, timeout, "the jobs to end")


def failures(r: dict[str, Any]) -> list[str]:
    return [f"{key} {r[key]}" for key in ("poison_extra_attempts", "cancelled_ran", "cost_violations", "lost") if r[key]]


def report(r: dict[str, Any]) -> None:
    common.print_table(
        ["closed loop", "jobs/s"],
        [["batched", r["batched_jobs_per_s"]], ["unbatched (one call per job)", r["unbatched_jobs_per_s"]],
         ["ideal (every slot a full batch)", r["ideal_jobs_per_s"]],
         ["dispatcher ceiling (these jobs, no-op handler)", r["ceiling_jobs_per_s"]],
         ["dispatcher best case (full no-op batches of one-field jobs)", r["noop_jobs_per_s"]]],
        title=f"batching: {r['agents']} agents x {r['capacity']} slots, {r['max_items']} a batch")
    print(f"mean batch {r['batched_mean_items']} items   speedup {r['speedup']}x   ideal_fraction {r['ideal_fraction']}   ceiling_fraction {r['ceiling_fraction']}")
    for run, used in r["cpu_us_per_job"].items():
        print(f"CPU per job, {run}: " + ", ".join(f"{k} {v} us" for k, v in used.items()))
    common.print_table(["rate /s", "batched p50 / p99 ms", "unbatched p50 / p99 ms"],
                       [[rate, f"{m['batched']['p50_ms']} / {m['batched']['p99_ms']}",
                         f"{m['unbatched']['p50_ms']} / {m['unbatched']['p99_ms']}"] for rate, m in r["open_loop"].items()],
                       title="open loop: enqueue -> done")
    print(f"poison_extra_attempts {r['poison_extra_attempts']}  cancelled_ran {r['cancelled_ran']}  "
          f"cost_violations {r['cost_violations']}  lost {r['lost']}")


if __name__ == "__main__":
    raise SystemExit(common.standalone("batching"))
