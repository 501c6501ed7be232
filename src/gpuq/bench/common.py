"""What every bench shares: where the database is, resetting the schema, output.

Output contract: a readable table on stdout, progress on stderr, and as the
LAST line of stdout exactly one JSON object with the bench's figures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import asyncpg

from gpuq import config
from gpuq.db import DatabaseUnavailable, redact
from gpuq.devdb import Cluster, DevDBError, throwaway_cluster
from gpuq.migrate import migrate

# Server settings each bench reports with its figures (and docs/benchmarks.md quotes).
REPORTED_SETTINGS = (
    "server_version", "shared_buffers", "work_mem", "fsync", "synchronous_commit",
    "full_page_writes", "max_connections", "random_page_cost", "effective_cache_size",
)
_SETTINGS_SQL = "SELECT name, setting, unit FROM pg_settings WHERE name = ANY($1::text[])"

_T0 = time.monotonic()


class Refused(RuntimeError):
    """The bench would drop a schema of a real database without --yes."""


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--database-url", default=None,
        help="PostgreSQL to run on (default: $DATABASE_URL, else a throwaway embedded "
             "cluster). The bench DROPS and recreates the gpuq schema there.",
    )
    p.add_argument("--yes", action="store_true",
                   help="confirm dropping the gpuq schema of the given database")


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


@contextmanager
def target(args: argparse.Namespace) -> Iterator[tuple[str, Cluster | None]]:
    """Yield ``(dsn, cluster)`` to bench on: the given/env database (with --yes; cluster
    None), or a throwaway embedded cluster (destroyed afterwards)."""
    url = config.get("database_url", flag=getattr(args, "database_url", None))
    if url:
        print(f"WARNING: this bench DROPS and recreates the gpuq schema in {redact(url)}",
              file=sys.stderr, flush=True)
        if not getattr(args, "yes", False):
            raise Refused("refusing without --yes (or run without a database URL to use a "
                          "throwaway embedded cluster)")
        yield url, None
        return
    progress("starting a throwaway embedded PostgreSQL cluster")
    cluster = throwaway_cluster()
    try:
        yield cluster.ensure_started(), cluster
    finally:
        progress("destroying the throwaway cluster")
        cluster.destroy()


@contextmanager
def target_database(args: argparse.Namespace) -> Iterator[str]:
    """``target()`` for benches that need only the DSN."""
    with target(args) as (dsn, _cluster):
        yield dsn


def guarded(run: Callable[[], int]) -> int:
    """Run a bench; turn the failures an operator can cause into one line and an exit code."""
    try:
        return run()
    except Refused as exc:
        print(f"gpuq bench: {exc}", file=sys.stderr)
        return 2
    except (DevDBError, DatabaseUnavailable, OSError, RuntimeError, asyncpg.PostgresError) as exc:
        print(f"gpuq bench: {exc}", file=sys.stderr)
        return 1


def run_bench(
    args: argparse.Namespace,
    body: Callable[[str], Coroutine[Any, Any, dict[str, Any]]],
    after: Callable[[dict[str, Any]], None] | None = None,
) -> int:
    """Run ``body(dsn)`` on the target database and emit its result; return the exit code.

    ``after(result)`` runs once the database is released (plots), before the JSON line.
    """

    def run() -> int:
        with target_database(args) as dsn:
            result = asyncio.run(body(dsn))
        if after is not None:
            after(result)
        emit(result)
        return 0

    return guarded(run)


def emit(result: dict[str, Any]) -> None:
    """The machine-readable result: one JSON object, the last line of stdout."""
    sys.stdout.flush()
    print(json.dumps(result, separators=(",", ":")), flush=True)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h)
              for i, h in enumerate(headers)]
    if title:
        print(title)
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    print()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


async def reset_gpuq_schema(dsn: str) -> None:
    """DROP the gpuq schema (every job in it!) and migrate it afresh."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("DROP SCHEMA IF EXISTS gpuq CASCADE")
    finally:
        await conn.close()
    await migrate(dsn)


async def server_settings(conn: Any) -> dict[str, str]:
    rows = await conn.fetch(_SETTINGS_SQL, list(REPORTED_SETTINGS))
    out = {}
    for r in rows:
        unit = r["unit"] or ""
        value = r["setting"]
        if unit == "8kB":
            value, unit = f"{int(value) * 8 // 1024}", "MB"
        out[r["name"]] = f"{value}{unit}"
    return out


def print_settings(settings: dict[str, str]) -> None:
    print("PostgreSQL: " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())))
    print(f"Machine: {os.cpu_count()} CPUs")
    print()


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, not {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError("expected one or more non-negative integers")
    return values


def positive_int(text: str) -> int:
    try:
        v = int(text.replace("_", ""))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, not {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {v}")
    return v
