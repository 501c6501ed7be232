"""``gpuq bench soak``: a steady load for minutes; serve's memory must level off.

One ``gpuq serve`` process, ``--agents`` agent processes and a producer
inserting ``--rate`` jobs per second for ``--seconds``. Every
``--sample-seconds`` the serve process's RSS is sampled. The figures: RSS once
warmed up (the first sample after the first 20% of the run), RSS at the end,
their ratio, jobs done, and the ERROR-level lines of serve's JSON log (plus
any traceback). Exit 1 when the ratio is above ``--max-ratio`` (1.2), when
serve logged an error, or when no job got done. The last stdout line is one
JSON object.
"""

from __future__ import annotations

import argparse
import shutil
import time
from dataclasses import dataclass
from typing import Any

import anyio
import asyncpg

from gpuq.bench import common
from gpuq.bench.measure import count_errors, rss_mb
from gpuq.harness import KIND, Fleet

WARMUP_FRACTION = 0.2


@dataclass
class SoakConfig:
    seconds: float = 600.0
    rate: float = 300.0  # jobs inserted per second
    agents: int = 4
    capacity: int = 8
    sample_seconds: float = 2.0
    max_ratio: float = 1.2
    keep_logs: bool = False


async def run_soak(dsn: str, cfg: SoakConfig) -> dict[str, Any]:
    """One soak on ``dsn`` (its gpuq schema is dropped and recreated)."""
    await common.reset_gpuq_schema(dsn)
    fleet = Fleet(dsn)
    out: dict[str, Any] = {}
    try:
        await anyio.to_thread.run_sync(lambda: fleet.start_serve(poll_seconds=0.5))
        assert fleet.serve is not None
        pid = fleet.serve.popen.pid
        await anyio.to_thread.run_sync(fleet.start_agents, cfg.agents, cfg.capacity, "gpuq.bench.handlers:work")
        common.progress(f"soak: serve pid {pid} on port {fleet.port}, {cfg.agents} agents; "
                 f"{cfg.rate:g} jobs/s for {cfg.seconds:g}s")
        samples: list[tuple[float, float]] = []  # (seconds since start, RSS MB)
        inserted = 0
        conn = await asyncpg.connect(dsn)
        try:
            t0 = next_sample = shown = time.monotonic()
            while (now := time.monotonic()) - t0 < cfg.seconds:
                fleet.check()
                if (due := int((now - t0) * cfg.rate) - inserted) > 0:
                    await conn.execute(common.queries["insert_pending"], KIND, due)
                    inserted += due
                if now >= next_sample:
                    samples.append((now - t0, rss_mb(pid)))
                    next_sample += cfg.sample_seconds
                if now - shown >= 30:
                    shown = now
                    common.progress(f"soak: t={now - t0:.0f}s inserted {inserted} rss {samples[-1][1]:.1f} MB")
                await anyio.sleep(0.1)
            samples.append((time.monotonic() - t0, rss_mb(pid)))
            with anyio.move_on_after(30):  # let the tail of the work finish (not measured)
                while await conn.fetchval(common.queries["count_live"]):
                    await anyio.sleep(0.2)
            totals = await conn.fetchrow(common.queries["totals"])
        finally:
            await conn.close()
        await anyio.to_thread.run_sync(fleet.stop)
        errors, examples = count_errors(fleet.serve.log.read_text(errors="replace"))
        warm_t, warm = next((p for p in samples if p[0] >= WARMUP_FRACTION * cfg.seconds), samples[-1])
        end = samples[-1][1]
        rss = [r for _, r in samples]
        out = {
            "seconds": cfg.seconds, "rate": cfg.rate, "agents": cfg.agents,
            "inserted": inserted, "done": totals["done"], "dead": totals["dead"],
            "rss_warm_mb": round(warm, 2), "rss_warm_at": round(warm_t, 1), "rss_end_mb": round(end, 2),
            "rss_peak_mb": round(max(rss), 2), "rss_min_mb": round(min(rss), 2),
            "ratio": round(end / warm, 3), "samples": len(samples),
            "errors": errors, "error_examples": examples, "serve_exit": fleet.serve.popen.returncode,
            "max_ratio": cfg.max_ratio, "logdir": str(fleet.logdir),
        }
        return out
    finally:
        await anyio.to_thread.run_sync(fleet.stop)
        if out and not failed(out) and not cfg.keep_logs:
            shutil.rmtree(fleet.logdir, ignore_errors=True)
        else:
            common.progress(f"soak: process logs kept in {fleet.logdir}")


def failed(out: dict[str, Any]) -> list[str]:
    bad = []
    if out["ratio"] > out["max_ratio"]:
        bad.append(f"rss ratio {out['ratio']} > {out['max_ratio']}")
    if out["errors"]:
        bad.append(f"{out['errors']} ERROR lines in serve's log")
    if not out["done"]:
        bad.append("no job done")
    return bad


def report(out: dict[str, Any]) -> None:
    common.print_pairs(f"gpuq soak: {out['seconds']:g}s at {out['rate']:g} jobs/s, {out['agents']} agents", [
        ("jobs inserted", out["inserted"]), ("jobs done", out["done"]), ("jobs dead", out["dead"]),
        ("serve RSS warm MB", f"{out['rss_warm_mb']:.1f} (t={out['rss_warm_at']:g}s)"),
        ("serve RSS end MB", out["rss_end_mb"]),
        ("serve RSS min/peak MB", f"{out['rss_min_mb']:.1f} / {out['rss_peak_mb']:.1f} over {out['samples']} samples"),
        ("ratio end/warm", f"{out['ratio']:.3f} (limit {out['max_ratio']:g})"),
        ("ERROR lines", out["errors"]), *(("  example", line[:200]) for line in out["error_examples"]),
    ])


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--seconds", type=float, default=600.0, help="length of the soak (default 600)")
        p.add_argument("--rate", type=float, default=300.0, help="jobs inserted per second (default 300)")
        common.fleet_args(p, agents=4, capacity=8)
        p.add_argument("--sample-seconds", type=float, default=2.0, help="RSS sampling interval (default 2)")
        p.add_argument("--max-ratio", type=float, default=1.2,
                       help="fail if RSS at the end exceeds this multiple of the warm RSS (default 1.2)")
        p.add_argument("--keep-logs", action="store_true", help="keep process logs even on success")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        return await run_soak(t.dsn, SoakConfig(a.seconds, a.rate, a.agents, a.capacity, a.sample_seconds,
                                                a.max_ratio, a.keep_logs))

    common.declare(sub, "soak", "steady load for minutes: serve's RSS levels off, no ERROR logged", __doc__, args,
            body, report, failed,
            summary=lambda out: {"bench": "soak", **{k: v for k, v in out.items()
                                                      if k not in ("error_examples", "logdir")}})


if __name__ == "__main__":
    raise SystemExit(common.standalone("soak"))
