"""``gpuq batch``: a kind's batching policy (how many of its jobs go in one handler call, how long a
partial batch may wait, a cost budget), set, removed or listed. A change is an admin event on stderr."""

from __future__ import annotations

import argparse
from typing import Any

from gpuq import config
from gpuq.batches import describe
from gpuq.cli.database import on_db
from gpuq.cli.errors import CLIError
from gpuq.cli.output import admin_event


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    b = sub.add_parser("batch", help="lease a kind's jobs in batches (one handler call each) for agents with a "
                                     "batch handler, across every server; no arguments: list the policies")
    b.add_argument("kind", metavar="KIND", nargs="?")
    b.add_argument("remove", metavar="none", nargs="?", choices=("none",), help="none: remove the kind's policy")
    b.add_argument("--max-items", type=int, metavar="N", help="jobs in one batch at most (1-4096)")
    b.add_argument("--max-wait-ms", type=int, default=0, metavar="MS",
                   help="a partial batch goes once its oldest job waited this long (default 0: at once)")
    b.add_argument("--max-cost", type=int, metavar="C",
                   help="the jobs' costs in one batch sum to at most this (a job over it alone runs alone)")
    config.add_flags(b, "batch")
    b.set_defaults(func=cmd_batch)


def cmd_batch(args: argparse.Namespace) -> int:
    from gpuq import admin

    removing = args.remove == "none"
    if args.kind is None:
        if args.remove or args.max_items is not None or args.max_cost is not None or args.max_wait_ms:
            raise CLIError("give the KIND: gpuq batch KIND --max-items N [--max-wait-ms MS] [--max-cost C]")
    elif removing == (args.max_items is not None):
        raise CLIError("give either --max-items N or none: gpuq batch KIND --max-items N | gpuq batch KIND none")

    async def run(conn: Any) -> list[dict[str, Any]]:
        if args.kind is not None:
            try:
                await admin.set_batching(conn, args.kind, None if removing else args.max_items,
                                         args.max_wait_ms, args.max_cost)
            except ValueError as exc:
                raise CLIError(str(exc)) from None
        return await admin.batching(conn)

    policies = on_db(args, run)
    if args.kind is None:
        for p in policies:
            print(describe(p))
        return 0
    admin_event("batch", kind=args.kind, max_items=None if removing else args.max_items,
                max_wait_ms=args.max_wait_ms, max_cost=args.max_cost)
    print(next((describe(p) for p in policies if p["kind"] == args.kind), f"{args.kind}: not batched"))
    return 0

