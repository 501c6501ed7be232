"""The commands that read jobs: ``show`` (one job, every column), ``jobs`` (a filtered page,
newest first), ``wait`` (until a job ends, with its progress)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import anyio

from gpuq import config
from gpuq.cli.database import dsn, on_db, pooled
from gpuq.cli.errors import CLIError
from gpuq.cli.output import table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sh = sub.add_parser("show", help="print one job, every column, as JSON")
    sh.add_argument("id", metavar="ID", type=int)
    config.add_flags(sh, "show")
    sh.set_defaults(func=cmd_show)

    jl = sub.add_parser("jobs", help="list jobs newest first, filtered, a page at a time (the dashboard's list)")
    jl.add_argument("--kind", help="only jobs of this kind")
    jl.add_argument("--state", help="only jobs in this state: pending, leased, scheduled, done, dead, cancelled, "
                                    "or failed (dead or cancelled)")
    jl.add_argument("--key", help="only jobs with this concurrency key")
    jl.add_argument("--error", help="only jobs whose last error contains this text")
    jl.add_argument("--before", type=int, help="the page below this id (the 'older' id a page prints)")
    jl.add_argument("--limit", type=int, default=50, help="jobs per page, 1-1000 (default 50)")
    jl.add_argument("--json", action="store_true", help="print one JSON object: jobs and the next page's id")
    config.add_flags(jl, "jobs")
    jl.set_defaults(func=cmd_jobs)

    wt = sub.add_parser("wait", help="wait for a job to end: print its result, or exit 1 if it died, was "
                                     "cancelled or the timeout passed")
    wt.add_argument("id", metavar="ID", type=int)
    wt.add_argument("--timeout", type=float, default=None, help="seconds (default: no limit)")
    wt.add_argument("--progress", action="store_true",
                    help="print the job's progress as it is stored, one JSON line each on stderr")
    config.add_flags(wt, "wait")
    wt.set_defaults(func=cmd_wait)


def cmd_show(args: argparse.Namespace) -> int:
    from gpuq import admin

    async def read(conn: Any) -> dict[str, Any] | None:
        found = await admin.show(conn, args.id)
        if found is not None:  # each attempt that did not succeed (the last one is the row itself)
            found["failed_attempts"] = await admin.attempts(conn, args.id)
        return found

    found = on_db(args, read)
    if found is None:
        raise CLIError(f"no job {args.id}")
    print(json.dumps(found, indent=2, default=str))
    return 0


def cmd_jobs(args: argparse.Namespace) -> int:
    from gpuq import admin
    from gpuq.jobs import JobFilter, error_line

    if not 1 <= args.limit <= 1000:
        raise CLIError(f"--limit must be 1-1000, not {args.limit}")
    try:
        which = JobFilter(kind=args.kind, state=args.state, key=args.key, error=args.error)
    except ValueError as exc:
        raise CLIError(str(exc)) from None
    page = on_db(args, lambda conn: admin.list_jobs(conn, which, args.before, args.limit))
    if args.json:
        print(json.dumps({"jobs": page.jobs, "older": page.older, "searched_to": page.searched_to}, default=str))
        return 0
    rows: list[tuple[str, ...]] = [("id", "kind", "state", "attempts", "created", "error")]
    rows += [(str(j["id"]), j["kind"], j["status"], f"{j['attempts']}/{j['max_attempts']}",
              j["created_at"].strftime("%Y-%m-%d %H:%M:%S"), error_line(j["error"])[:60])
             for j in page.jobs]
    print("\n".join(table(rows, right={0, 3})))
    if page.searched_to:
        print(f"(looked at ids from {page.searched_to} up)")
    if page.older:
        print(f"older: gpuq jobs ... --before {page.older}")
    return 0


def cmd_wait(args: argparse.Namespace) -> int:
    from gpuq.producer import JobError, wait

    def show_progress(progress: dict[str, Any]) -> None:
        print(json.dumps(progress), file=sys.stderr, flush=True)

    on_progress = show_progress if args.progress else None
    try:
        if pooled(args):
            result = on_db(args, lambda conn: wait(conn, args.id, args.timeout, on_progress=on_progress))
        else:  # on the DSN: a lost or hung connection is replaced, the wait goes on
            result = anyio.run(lambda: wait(dsn(args), args.id, args.timeout, on_progress=on_progress))
    except JobError as exc:
        raise CLIError(str(exc)) from None
    print(json.dumps(result))
    return 0
