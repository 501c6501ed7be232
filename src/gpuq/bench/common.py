"""What every bench shares: declaring it, where the database is, its SQL, output.

Output contract: a readable table on stdout, progress on stderr, and as the
LAST line of stdout exactly one JSON object with the bench's figures.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any

import anyio
import asyncpg

from gpuq import config, sql
from gpuq.db import DatabaseUnavailable, connect, redact
from gpuq.devdb import Cluster, DevDBError, throwaway_cluster
from gpuq.harness import Fleet
from gpuq.migrate import migrate
from gpuq.runtime import use_uvloop

queries = sql.parse(resources.files(__name__.rsplit(".", 1)[0]).joinpath("queries.sql").read_text())

# Server settings each bench reports with its figures (and docs/benchmarks.md quotes).
REPORTED_SETTINGS = (
    "server_version", "shared_buffers", "work_mem", "fsync", "synchronous_commit",
    "full_page_writes", "max_connections", "random_page_cost", "effective_cache_size",
)
_T0 = time.monotonic()


class Refused(RuntimeError):
    """The bench would drop a schema of a real database without --yes."""


# -- declaring a bench --------------------------------------------------------


@dataclass(frozen=True)
class Target:
    dsn: str
    cluster: Cluster | None  # the throwaway embedded cluster, None for --database-url


Body = Callable[[Target, argparse.Namespace], Awaitable[dict[str, Any]]]


def declare(sub: Any, name: str, help: str, doc: str | None, args: Callable[[Any], None], body: Body,
            report: Callable[[dict[str, Any]], None] | None = None,
            failures: Callable[[dict[str, Any]], list[str]] | None = None,
            summary: Callable[[dict[str, Any]], dict[str, Any]] | None = None, database: bool = True) -> None:
    """Add ``gpuq bench NAME``: ``args(parser)`` adds its flags, ``body(target, args)`` measures.

    ``database=False``: the bench builds its own PostgreSQL servers; it gets no
    ``--database-url`` and its body an empty ``Target``.

    After the run, ``report(result)`` prints the table, the JSON line is
    ``summary(result)`` (default: the result), and the exit code is 1 when
    ``failures(result)`` names any broken guarantee.
    """
    p = sub.add_parser(name, help=help, description=(doc or "").split("\n\n")[0] or None)
    args(p)
    if database:
        p.add_argument("--database-url", default=None,
                       help="PostgreSQL to run on (default: $DATABASE_URL, else a throwaway embedded "
                            "cluster). The bench DROPS and recreates the gpuq schema there.")
        p.add_argument("--yes", action="store_true", help="confirm dropping the gpuq schema of the given database")

    def run(ns: argparse.Namespace) -> int:
        def once() -> int:
            with target(ns) if database else contextlib.nullcontext(Target("", None)) as t:
                result = anyio.run(body, t, ns, backend_options={"use_uvloop": use_uvloop()})
            if report is not None:
                report(result)
            bad = failures(result) if failures else []
            if failures is not None:
                print("VERDICT: " + ("OK" if not bad else "FAILED: " + "; ".join(bad)))
            emit(summary(result) if summary else result)
            return 1 if bad else 0

        return guarded(once)

    p.set_defaults(bench=run)


@contextlib.contextmanager
def target(args: argparse.Namespace) -> Iterator[Target]:
    """The given/env database (with --yes), or a throwaway embedded cluster (destroyed afterwards)."""
    url = config.get("database_url", flag=getattr(args, "database_url", None))
    if url:
        print(f"WARNING: this bench DROPS and recreates the gpuq schema in {redact(url)}",
              file=sys.stderr, flush=True)
        if not getattr(args, "yes", False):
            raise Refused("refusing without --yes (or run without a database URL to use a "
                          "throwaway embedded cluster)")
        yield Target(url, None)
        return
    progress("starting a throwaway embedded PostgreSQL cluster")
    cluster = throwaway_cluster()
    try:
        yield Target(cluster.ensure_started(), cluster)
    finally:
        progress("destroying the throwaway cluster")
        cluster.destroy()


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


def standalone(name: str, argv: list[str] | None = None) -> int:
    """``python -m gpuq.bench.MODULE ...``: the same as ``gpuq bench NAME ...``."""
    from gpuq.bench import main

    return main([name, *(sys.argv[1:] if argv is None else argv)])


# -- the database and the fleet ----------------------------------------------


async def reset_gpuq_schema(dsn: str) -> None:
    """DROP the gpuq schema (every job in it!) and migrate it afresh."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(queries["drop_schema"])
    finally:
        await conn.close()
    await migrate(dsn)


async def server_settings(conn: Any) -> dict[str, str]:
    out = {}
    for r in await conn.fetch(queries["server_settings"], list(REPORTED_SETTINGS)):
        unit, value = r["unit"] or "", r["setting"]
        if unit == "8kB":
            value, unit = f"{int(value) * 8 // 1024}", "MB"
        out[r["name"]] = f"{value}{unit}"
    return out


@contextlib.asynccontextmanager
async def fleet_on(dsn: str) -> AsyncIterator[tuple[Fleet, Any, dict[str, str]]]:
    """A fresh gpuq schema, a ``Fleet`` (not started), a connection and the server's settings;
    the fleet is stopped and the connection closed on exit."""
    await reset_gpuq_schema(dsn)
    fleet = Fleet(dsn)
    conn = await connect(dsn, command_timeout=None)  # it seeds tables: no GPUQ_COMMAND_TIMEOUT
    try:
        yield fleet, conn, await server_settings(conn)
    finally:
        await conn.close()
        await anyio.to_thread.run_sync(fleet.stop)


async def wait_until(done: Callable[[], Awaitable[bool]], fleet: Fleet, timeout: float, what: str,
                     show: Callable[[], Awaitable[str]] | None = None) -> None:
    """Poll ``done()`` every 50 ms while the fleet lives; progress every 5 s; fail after ``timeout``."""
    deadline = shown = time.monotonic()
    deadline += timeout
    while not await done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}; serve log:\n"
                               f"{fleet.serve.tail() if fleet.serve else ''}")
        fleet.check()
        if show is not None and time.monotonic() - shown > 5:
            shown = time.monotonic()
            progress(await show())
        await anyio.sleep(0.05)


# -- output -----------------------------------------------------------------


def progress(msg: str) -> None:
    print(f"[{time.monotonic() - _T0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def emit(result: dict[str, Any]) -> None:
    """The machine-readable result: one JSON object, the last line of stdout."""
    sys.stdout.flush()
    print(json.dumps(result, separators=(",", ":"), default=str), flush=True)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(title)
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
    print()


def print_pairs(title: str, pairs: Sequence[tuple[str, Any]]) -> None:
    """A titled list of ``label  value`` lines."""
    width = max(len(k) for k, _ in pairs)
    print(title)
    for k, v in pairs:
        print(f"  {k.ljust(width)}  {_fmt(v)}")
    print()


def print_settings(settings: dict[str, str]) -> None:
    print("PostgreSQL: " + ", ".join(f"{k}={v}" for k, v in sorted(settings.items())))
    print(f"Machine: {os.cpu_count()} CPUs")
    print()


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 100 else f"{v:,.0f}"
    if isinstance(v, int) and not isinstance(v, bool):
        return f"{v:,}"
    return str(v)


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


# -- argument types -----------------------------------------------------------


def positive(p: argparse.ArgumentParser, flag: str, default: float, what: str) -> None:
    """A positive ``flag`` (an int when ``default`` is one, else a float), its help ``what (default N)``."""
    if isinstance(default, int):
        p.add_argument(flag, type=positive_int, default=default, help=f"{what} (default {default})")
    else:
        p.add_argument(flag, type=positive_float, default=default, help=f"{what} (default {default:g})")


def fleet_args(p: argparse.ArgumentParser, agents: int, capacity: int, what: str = "agent processes") -> None:
    """``--agents`` and ``--capacity`` with this bench's defaults."""
    positive(p, "--agents", agents, what)
    positive(p, "--capacity", capacity, "capacity of each agent")


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


def positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, not {text!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, not {v}")
    return v
