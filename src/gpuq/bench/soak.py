"""``gpuq bench soak``: a steady load for minutes; serve's memory must level off.

One ``gpuq serve`` process, ``--agents`` agent processes and a producer
inserting ``--rate`` jobs per second for ``--seconds``. Every
``--sample-seconds`` the serve process's RSS is sampled (psutil, else
``/proc/<pid>/status`` VmRSS). The figures: RSS once warmed up (the first
sample after the first 20% of the run), RSS at the end, their ratio, jobs
done, and the ERROR-level lines of serve's JSON log (plus any traceback).

Exit 1 when the ratio is above ``--max-ratio`` (1.2), when serve logged an
error, or when no job got done. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import asyncpg

from gpuq.bench.common import add_common_args, positive_int, progress, run_bench
from gpuq.bench.common import reset_gpuq_schema as _reset
from gpuq.bench.procs import KIND, Fleet

WARMUP_FRACTION = 0.2
ERROR_LEVELS = {"error", "critical", "exception", "fatal"}

_INSERT = ("INSERT INTO gpuq.jobs (kind, payload) "
           "SELECT $1, jsonb_build_object('n', g) FROM generate_series(1, $2::int) AS g")


async def work(job: Any) -> dict[str, Any]:
    """The agents' handler: a couple of milliseconds of 'GPU time'."""
    await anyio.sleep(0.002)
    return {"id": job.id}


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (psutil if installed, else /proc)."""
    try:
        import psutil
    except ImportError:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
        raise OSError(f"no VmRSS for pid {pid}") from None
    return int(psutil.Process(pid).memory_info().rss)


def count_errors(log_text: str) -> tuple[int, list[str]]:
    """ERROR-level JSON lines and traceback starts in a serve log; (count, first few lines)."""
    errors: list[str] = []
    for line in log_text.splitlines():
        stripped = line.strip()
        if stripped.startswith("{"):
            try:
                obj = json.loads(stripped)
            except ValueError:
                continue
            if isinstance(obj, dict) and str(obj.get("level", "")).lower() in ERROR_LEVELS:
                errors.append(stripped)
        elif stripped.startswith("Traceback"):
            errors.append(stripped)
    return len(errors), errors[:5]


@dataclass
class SoakConfig:
    seconds: float = 600.0
    rate: float = 300.0  # jobs inserted per second
    agents: int = 4
    capacity: int = 8
    sample_seconds: float = 2.0
    max_ratio: float = 1.2
    keep_logs: bool = False


@dataclass
class Samples:
    points: list[tuple[float, int]] = field(default_factory=list)  # (seconds since start, rss bytes)

    def warm(self, seconds: float) -> tuple[float, int]:
        after = [p for p in self.points if p[0] >= WARMUP_FRACTION * seconds]
        return after[0] if after else self.points[-1]


async def run_soak(dsn: str, cfg: SoakConfig, *, reset: bool = True) -> dict[str, Any]:
    """One soak on ``dsn`` (its gpuq schema is dropped and recreated unless ``reset=False``)."""
    if reset:
        await _reset(dsn)
    fleet = Fleet(dsn)
    ok = False
    try:
        await asyncio.to_thread(fleet.start_serve, 0.5)
        assert fleet.serve is not None
        pid = fleet.serve.popen.pid
        await asyncio.to_thread(fleet.start_agents, cfg.agents, cfg.capacity, "gpuq.bench.soak:work")
        progress(f"soak: serve pid {pid} on port {fleet.port}, {cfg.agents} agents; "
                 f"{cfg.rate:g} jobs/s for {cfg.seconds:g}s")
        samples = Samples()
        inserted = 0
        conn = await asyncpg.connect(dsn)
        t0 = time.monotonic()
        next_sample = t0
        shown = t0
        try:
            tick = 0.1
            while (now := time.monotonic()) - t0 < cfg.seconds:
                if not fleet.serve.alive():
                    raise RuntimeError(f"serve exited ({fleet.serve.popen.returncode}) during the "
                                       f"soak; its log:\n{fleet.serve.tail()}")
                due = int((now - t0) * cfg.rate) - inserted
                if due > 0:
                    await conn.execute(_INSERT, KIND, due)
                    inserted += due
                if now >= next_sample:
                    samples.points.append((now - t0, rss_bytes(pid)))
                    next_sample += cfg.sample_seconds
                if now - shown >= 30:
                    shown = now
                    progress(f"soak: t={now - t0:.0f}s inserted {inserted} "
                             f"rss {samples.points[-1][1] / 2**20:.1f} MB")
                await asyncio.sleep(tick)
            samples.points.append((time.monotonic() - t0, rss_bytes(pid)))
            # Let the tail of the work finish (not part of the measured window).
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                live = await conn.fetchval(
                    "SELECT count(*) FROM gpuq.jobs WHERE status IN ('pending', 'leased', 'scheduled')")
                if not live:
                    break
                await asyncio.sleep(0.2)
            done = int(await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = 'done'"))
            dead = int(await conn.fetchval("SELECT count(*) FROM gpuq.jobs WHERE status = 'dead'"))
        finally:
            await conn.close()
        await asyncio.to_thread(fleet.stop)
        exit_code = fleet.serve.popen.returncode
        errors, examples = count_errors(fleet.serve.log.read_text(errors="replace"))
        warm_t, warm = samples.warm(cfg.seconds)
        end_t, end = samples.points[-1]
        out = {
            "seconds": cfg.seconds, "rate": cfg.rate, "agents": cfg.agents,
            "inserted": inserted, "done": done, "dead": dead,
            "rss_warm_mb": round(warm / 2**20, 2), "rss_warm_at": round(warm_t, 1),
            "rss_end_mb": round(end / 2**20, 2),
            "rss_peak_mb": round(max(r for _, r in samples.points) / 2**20, 2),
            "rss_min_mb": round(min(r for _, r in samples.points) / 2**20, 2),
            "ratio": round(end / warm, 3), "samples": len(samples.points),
            "errors": errors, "error_examples": examples, "serve_exit": exit_code,
            "max_ratio": cfg.max_ratio, "logdir": str(fleet.logdir),
        }
        ok = not failed(out)
        return out
    finally:
        await asyncio.to_thread(fleet.stop)
        if ok and not cfg.keep_logs:
            shutil.rmtree(fleet.logdir, ignore_errors=True)
        else:
            progress(f"soak: process logs kept in {fleet.logdir}")


def failed(out: dict[str, Any]) -> list[str]:
    bad = []
    if out["ratio"] > out["max_ratio"]:
        bad.append(f"rss ratio {out['ratio']} > {out['max_ratio']}")
    if out["errors"]:
        bad.append(f"{out['errors']} ERROR lines in serve's log")
    if not out["done"]:
        bad.append("no job done")
    return bad


def print_report(out: dict[str, Any]) -> None:
    print(f"gpuq soak: {out['seconds']:g}s at {out['rate']:g} jobs/s, {out['agents']} agents")
    print(f"  jobs inserted        {out['inserted']:,}")
    print(f"  jobs done            {out['done']:,} (dead {out['dead']:,})")
    print(f"  serve RSS warm       {out['rss_warm_mb']:.1f} MB (t={out['rss_warm_at']:g}s)")
    print(f"  serve RSS end        {out['rss_end_mb']:.1f} MB")
    print(f"  serve RSS min/peak   {out['rss_min_mb']:.1f} / {out['rss_peak_mb']:.1f} MB "
          f"over {out['samples']} samples")
    print(f"  ratio end/warm       {out['ratio']:.3f} (limit {out['max_ratio']:g})")
    print(f"  ERROR lines          {out['errors']}")
    for line in out["error_examples"]:
        print(f"    {line[:200]}")
    bad = failed(out)
    print("VERDICT: " + ("OK" if not bad else "FAILED: " + "; ".join(bad)))
    print()


def add_args(p: argparse.ArgumentParser) -> None:
    add_common_args(p)
    p.add_argument("--seconds", type=float, default=600.0, help="length of the soak (default 600)")
    p.add_argument("--rate", type=float, default=300.0, help="jobs inserted per second (default 300)")
    p.add_argument("--agents", type=positive_int, default=4, help="agent processes (default 4)")
    p.add_argument("--capacity", type=positive_int, default=8, help="capacity of each agent (default 8)")
    p.add_argument("--sample-seconds", type=float, default=2.0, help="RSS sampling interval (default 2)")
    p.add_argument("--max-ratio", type=float, default=1.2,
                   help="fail if RSS at the end exceeds this multiple of the warm RSS (default 1.2)")
    p.add_argument("--keep-logs", action="store_true", help="keep process logs even on success")


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    return SoakConfig(seconds=args.seconds, rate=args.rate, agents=args.agents, capacity=args.capacity,
                      sample_seconds=args.sample_seconds, max_ratio=args.max_ratio,
                      keep_logs=args.keep_logs)


def bench(args: argparse.Namespace) -> int:
    cfg = config_from_args(args)
    holder: dict[str, Any] = {}

    async def body(dsn: str) -> dict[str, Any]:
        out = await run_soak(dsn, cfg)
        holder.update(out)
        return {"bench": "soak", **{k: v for k, v in out.items() if k not in ("error_examples", "logdir")}}

    code = run_bench(args, body, after=lambda _r: print_report(holder))
    if code == 0 and failed(holder):
        return 1
    return code


def register(sub: Any) -> None:
    p = sub.add_parser("soak", help="steady load for minutes: serve's RSS levels off, no ERROR logged")
    add_args(p)
    p.set_defaults(bench=bench)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpuq bench soak", description=(__doc__ or "").split("\n\n")[0])
    add_args(p)
    return bench(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())


__all__ = ["SoakConfig", "count_errors", "register", "rss_bytes", "run_soak", "work", "main"]
