"""``gpuq schedule``: periodic jobs (a cron expression enqueues a job of a kind on each tick):
add, list, remove."""

from __future__ import annotations

import argparse
import getpass
import json
from typing import Any

from gpuq import config
from gpuq.cli.database import on_db
from gpuq.cli.errors import EXIT_FAILURE
from gpuq.cli.output import admin_event
from gpuq.cli.values import json_arg


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    sc = sub.add_parser("schedule", help="periodic jobs: add, list, remove (a cron expression enqueues a job "
                                         "of a kind on each tick)")
    config.add_flags(sc, "schedule")
    ssub = sc.add_subparsers(dest="action", metavar="ACTION", required=True)
    sa = ssub.add_parser("add", help="create a schedule; its first run is the first tick after now")
    sa.add_argument("name", metavar="NAME")
    sa.add_argument("--cron", required=True, help="five fields, UTC: minute hour day-of-month month day-of-week")
    sa.add_argument("--kind", required=True, help="the kind of job each tick enqueues")
    sa.add_argument("--payload", default="null", help="the job's payload, JSON (default null)")
    sa.add_argument("--priority", type=int, default=0)
    sa.add_argument("--max-attempts", type=int, default=5)
    sl = ssub.add_parser("list", help="every schedule and its next run")
    sl.add_argument("--json", action="store_true", help="print JSON instead of a table")
    sr = ssub.add_parser("remove", help="delete a schedule (jobs it already enqueued stay)")
    sr.add_argument("name", metavar="NAME")
    sc.set_defaults(func=cmd_schedule)


def cmd_schedule(args: argparse.Namespace) -> int:
    from gpuq import schedules

    if args.action == "add":
        schedule = schedules.Schedule(args.name, args.cron, args.kind, json_arg(args.payload, "--payload"),
                                      args.priority, args.max_attempts)
        got: Any = on_db(args, lambda conn: schedules.add(conn, schedule, by=getpass.getuser()))
    elif args.action == "remove":
        got = on_db(args, lambda conn: schedules.remove(conn, args.name))
    else:
        got = on_db(args, schedules.listing)
    if args.action == "list":
        if args.json:
            print(json.dumps(got, indent=2, default=str))
        for s in [] if args.json else got:
            print(f"{s['name']}  {s['cron']!r}  kind={s['kind']}  next={s['next_run_at'].isoformat()}")
        return 0
    admin_event(f"schedule_{args.action}", name=args.name, **({"cron": args.cron, "kind": args.kind}
                                                              if args.action == "add" else {"removed": got}))
    if args.action == "add":
        print(f"{args.name}: first run at {got.isoformat()}")
        return 0
    print(f"{args.name}: removed" if got else f"{args.name}: no such schedule")
    return 0 if got else EXIT_FAILURE
