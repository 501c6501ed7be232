"""``gpuq bench busy``: how busy capacity-1 slots stay while work is queued.

A real ``gpuq serve`` and ``--agents`` agent processes of capacity 1 run a
backlog of ``--jobs`` jobs queued before they start; each handler sleeps
``--sleep-ms`` (async: ``gpuq.bench.handlers:busy_async``, then sync:
``busy_sync``, the same backlog again) and returns when it ran; then both
again with the agents' prefetch off (``GPUQ_PREFETCH=0``). Per agent,
sorted by start, each *gap* is the next job's start minus the previous
job's end (handler returned -> next handler started, one clock: the agent's).

Figures (issue #17): ``busy_fraction_*`` = the handlers' time over (slots x
wall time, first start to last end), target >= 0.97 for 20 ms jobs;
``gap_p50_ms`` / ``gap_p99_ms`` over both runs, target p50 <= 0.5 ms;
``duplicate_starts``: jobs that ran more than once (must be 0). The same
figures with prefetch off end in ``_no_prefetch``. ``busy_fraction_reported_*``
is what the agents themselves reported (protocol 6 heartbeats, read from the
server's ``/metrics``): handler time over handler time plus the gaps while
work waited, so the backlog's tail, when slots idle for want of work, is
not in it.
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any

import anyio

from gpuq.bench import common
from gpuq.bench.measure import percentiles
from gpuq.harness import KIND, fetch

HANDLERS = {"async": "gpuq.bench.handlers:busy_async", "sync": "gpuq.bench.handlers:busy_sync"}


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        common.positive(p, "--agents", 4, "agent processes, capacity 1")
        common.positive(p, "--jobs", 2000, "backlog per run")
        common.positive(p, "--sleep-ms", 20.0, "each handler's sleep")
        p.add_argument("--prefetch", type=int, default=1, help="the agents' prefetch for the first runs (default 1)")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        result: dict[str, Any] = {"bench": "busy", "agents": a.agents, "jobs": a.jobs, "sleep_ms": a.sleep_ms,
                                  "prefetch": a.prefetch, "duplicate_starts": 0}
        for prefetch, suffix in ((a.prefetch, ""), (0, "_no_prefetch")):
            gaps: list[float] = []
            for mode, handler in HANDLERS.items():
                run = await run_backlog(t.dsn, a.agents, a.jobs, a.sleep_ms / 1000, handler, prefetch)
                gaps += run.pop("gaps_ms")
                result["duplicate_starts"] += run.pop("duplicate_starts")
                result.update({f"{k}_{mode}{suffix}": v for k, v in run.items()})
            result.update({f"gap_{k}{suffix}": v for k, v in percentiles(gaps).items() if k in ("p50_ms", "p99_ms")})
        return result

    common.declare(sub, "busy", "slot busy fraction and the gap between jobs, capacity-1 agents, queued backlog",
                   __doc__, args, body, report,
                   failures=lambda r: [f"{r['duplicate_starts']} duplicate starts"] if r["duplicate_starts"] else [])


async def run_backlog(dsn: str, agents: int, jobs: int, sleep_s: float, handler: str,
                      prefetch: int) -> dict[str, Any]:
    async with common.fleet_on(dsn) as (fleet, conn, _settings):
        await conn.execute("INSERT INTO gpuq.jobs (kind, payload) SELECT $1, jsonb_build_object('sleep', $2::float8) "
                           "FROM generate_series(1, $3)", KIND, sleep_s, jobs)
        common.progress(f"{jobs} jobs queued; starting serve and {agents} agents ({handler.rsplit(':')[1]}, "
                        f"prefetch {prefetch})")
        # Heartbeats carry the agents' reports: often, so the last arrives soon after the backlog.
        await anyio.to_thread.run_sync(fleet.start_serve, {"GPUQ_HEARTBEAT_SECONDS": str(REPORT_SECONDS)})
        await anyio.to_thread.run_sync(fleet.start_agents, agents, 1, handler, {"GPUQ_PREFETCH": str(prefetch)})

        async def finished() -> bool:
            return bool(await conn.fetchval(common.queries["count_done"]) >= jobs)

        await common.wait_until(finished, fleet, 60 + jobs * sleep_s * 4 / agents, f"{jobs} jobs done")
        rows = await conn.fetch("SELECT result, attempts FROM gpuq.jobs")

        async def all_reported() -> bool:
            return (await anyio.to_thread.run_sync(reported, fleet.port))["starts"] >= jobs

        await common.wait_until(all_reported, fleet, 10 * REPORT_SECONDS + 10, "the agents' reports")
        told = await anyio.to_thread.run_sync(reported, fleet.port)
    out = measure([r["result"] for r in rows], sum(r["attempts"] > 1 for r in rows), agents)
    out["busy_fraction_reported"] = round(told["busy"] / (told["busy"] + told["gaps"]), 4)
    return out


REPORT_SECONDS = 0.5


def reported(port: int) -> dict[str, float]:
    """The agents' reports summed on the server's /metrics: handler seconds, gap seconds, starts."""
    from prometheus_client.parser import text_string_to_metric_families

    want = {"gpuq_slot_busy_seconds_total": "busy", "gpuq_slot_gap_seconds_sum": "gaps",
            "gpuq_slot_gap_seconds_count": "starts"}
    out = dict.fromkeys(want.values(), 0.0)
    for family in text_string_to_metric_families(fetch(f"http://127.0.0.1:{port}/metrics", timeout=5)[2]):
        for sample in family.samples:
            if sample.name in want:
                out[want[sample.name]] = sample.value
    return out


def measure(results: list[dict[str, Any]], repeated: int, slots: int) -> dict[str, Any]:
    """Busy fraction and gaps from the handlers' own (start, end, pid) records."""
    by_agent: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for r in results:
        by_agent[r["pid"]].append((r["start"], r["end"]))
    busy = sum(end - start for runs in by_agent.values() for start, end in runs)
    wall = max(end for runs in by_agent.values() for _, end in runs) - min(
        start for runs in by_agent.values() for start, _ in runs)
    gaps = [(b[0] - a[1]) * 1000 for runs in by_agent.values()
            for a, b in zip(sorted(runs), sorted(runs)[1:], strict=False)]
    return {"busy_fraction": round(busy / (slots * wall), 4), "wall_s": round(wall, 3),
            "ideal_s": round(busy / slots, 3), "gaps_ms": gaps, "duplicate_starts": repeated}


def report(r: dict[str, Any]) -> None:
    rows = [[f"{mode}, prefetch {p}", r[f"busy_fraction_{mode}{x}"], r[f"busy_fraction_reported_{mode}{x}"],
             r[f"wall_s_{mode}{x}"], r[f"ideal_s_{mode}{x}"], r[f"gap_p50_ms{x}"], r[f"gap_p99_ms{x}"]]
            for p, x in ((r["prefetch"], ""), (0, "_no_prefetch")) for mode in HANDLERS]
    common.print_table(["handler", "busy fraction", "agents reported", "wall s", "ideal s", "gap p50 ms",
                        "gap p99 ms"], rows,
                       title=f"busy: {r['jobs']} queued jobs of {r['sleep_ms']} ms, {r['agents']} agents x 1 slot "
                             "(gaps: both handlers together)")
    print(f"targets: busy >= 0.97, gap p50 <= 0.5 ms; duplicate starts: {r['duplicate_starts']}")


if __name__ == "__main__":
    raise SystemExit(common.standalone("busy"))
