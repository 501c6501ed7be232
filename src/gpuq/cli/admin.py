"""The admin commands on jobs and kinds: ``cancel``, ``preempt``, ``kind-timeout``, ``limit``, ``pause``,
``resume``, ``retry``. Each change is an admin event on stderr naming who made it."""

from __future__ import annotations

import argparse
import getpass
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from gpuq import config
from gpuq.cli.database import on_db
from gpuq.cli.errors import EXIT_FAILURE, CLIError
from gpuq.cli.output import admin_event
from gpuq.cli.values import timestamp, whole_or_none

T = TypeVar("T")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    c = sub.add_parser("cancel", help="cancel jobs, pending or running: they end cancelled and are not retried")
    c.add_argument("ids", metavar="ID", type=int, nargs="+")
    config.add_flags(c, "cancel")
    c.set_defaults(func=cmd_cancel)

    pe = sub.add_parser("preempt", help="ask running preemptible jobs to yield: they go back to pending, the "
                                        "attempt not counted, once their agent stops them (within their grace time)")
    pe.add_argument("ids", metavar="ID", type=int, nargs="+")
    config.add_flags(pe, "preempt")
    pe.set_defaults(func=cmd_preempt)

    kt = sub.add_parser("kind-timeout", help="the default execution timeout of a kind's jobs (those without "
                                             "their own); no arguments: list them")
    kt.add_argument("kind", metavar="KIND", nargs="?")
    kt.add_argument("seconds", metavar="SECONDS|none", nargs="?", help="seconds per attempt, or none to remove")
    config.add_flags(kt, "kind-timeout")
    kt.set_defaults(func=cmd_kind_timeout)

    lim = sub.add_parser("limit", help="at most N jobs running at once of a kind, or under a concurrency key, "
                                       "across every server; no arguments: list them with what runs now")
    lim.add_argument("scope", metavar="kind|key", nargs="?", choices=("kind", "key"))
    lim.add_argument("name", metavar="NAME", nargs="?", help="the kind, or the concurrency key")
    lim.add_argument("max_running", metavar="N|none", nargs="?", help="jobs at once, or none to remove the limit")
    config.add_flags(lim, "limit")
    lim.set_defaults(func=cmd_limit)

    for name, verb in (("pause", "stop leasing"), ("resume", "lease again")):
        pr = sub.add_parser(name, help=f"{verb} every job of a kind, on every dispatcher (running jobs finish)")
        pr.add_argument("kind", metavar="KIND")
        config.add_flags(pr, name)
        pr.set_defaults(func=cmd_pause_resume)

    _register_retry(sub)


def _register_retry(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    r = sub.add_parser("retry", help="send dead or cancelled jobs back to pending with fresh attempts, "
                                     "by id or by filter")
    r.add_argument("ids", metavar="ID", type=int, nargs="*", help="job ids (or use the filters)")
    r.add_argument("--kind", help="only jobs of this kind")
    r.add_argument("--error", help="only jobs whose last error contains this text")
    r.add_argument("--since", type=timestamp, help="only jobs that ended at or after this time (ISO 8601)")
    r.add_argument("--until", type=timestamp, help="only jobs that ended before this time (ISO 8601)")
    r.add_argument("--state", choices=("dead", "cancelled"), help="only dead or only cancelled jobs (default: both)")
    r.add_argument("--key", help="only jobs with this concurrency key")
    r.add_argument("--fresh", action="store_true",
                   help="drop their checkpoints: they start over (default: the next attempt resumes from each one's)")
    r.add_argument("--dry-run", action="store_true", help="print how many would go, change nothing")
    config.add_flags(r, "retry")
    r.set_defaults(func=cmd_retry)


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel each id; one line per id. Exit 1 if any was not live (finished or unknown)."""
    from gpuq import admin

    cancelled = on_db(args, lambda conn: admin.cancel(conn, *args.ids))
    admin_event("cancel", ids=args.ids, cancelled=sorted(cancelled))
    for job_id in args.ids:
        was = cancelled.get(job_id)
        print(f"{job_id}: cancelled (was {was})" if was else f"{job_id}: not live (finished, or no such job)")
    return 0 if len(cancelled) == len(set(args.ids)) else EXIT_FAILURE


def cmd_preempt(args: argparse.Namespace) -> int:
    """Preempt each id; one line per id. Exit 1 if any was not asked (not running, not preemptible,
    no preemptions left, or asked within its grace time)."""
    from gpuq import admin

    asked = on_db(args, lambda conn: admin.preempt(conn, *args.ids))
    admin_event("preempt", ids=args.ids, preempted=sorted(asked))
    for job_id in args.ids:
        grace = asked.get(job_id)
        print(f"{job_id}: asked to yield within {grace:g} s" if grace is not None else
              f"{job_id}: not preempted (not running, not preemptible, no preemptions left, or asked already)")
    return 0 if len(asked) == len(set(args.ids)) else EXIT_FAILURE


def _change_then_list(args: argparse.Namespace, change: Callable[[Any], Awaitable[object]] | None,
                      listing: Callable[[Any], Awaitable[T]]) -> T:
    """``change(conn)`` if given, then ``listing(conn)``: what a set-or-list command prints."""

    async def run(conn: Any) -> T:
        if change is not None:
            await change(conn)
        return await listing(conn)

    return on_db(args, run)


def cmd_kind_timeout(args: argparse.Namespace) -> int:
    from gpuq import admin

    if args.kind is not None and args.seconds is None:
        raise CLIError("give SECONDS (or none) after the kind; no arguments lists the defaults")
    seconds = whole_or_none(args.seconds, "timeout must be whole seconds")
    change = None if args.kind is None else (lambda conn: admin.set_kind_timeout(conn, args.kind, seconds))
    defaults = _change_then_list(args, change, admin.kind_timeouts)
    if args.kind is not None:
        admin_event("kind_timeout", kind=args.kind, seconds=seconds)
        print(f"{args.kind}: default timeout {f'{seconds} s' if seconds else 'none'}")
    else:
        for kind, value in defaults.items():
            print(f"{kind}  {value} s")
    return 0


def cmd_limit(args: argparse.Namespace) -> int:
    from gpuq import admin

    if args.scope is not None and args.max_running is None:
        raise CLIError("give NAME and N (or none): gpuq limit kind|key NAME N|none; no arguments lists them")
    limit = whole_or_none(args.max_running, "a limit is a whole number of jobs")

    async def change(conn: Any) -> None:
        try:
            await admin.set_limit(conn, args.scope, args.name, limit)
        except ValueError as exc:
            raise CLIError(str(exc)) from None

    limits = _change_then_list(args, None if args.scope is None else change, admin.limits)
    if args.scope is not None:
        admin_event("limit", scope=args.scope, name=args.name, max_running=limit)
        print(f"{args.scope} {args.name}: {'at most ' + str(limit) + ' running' if limit is not None else 'no limit'}")
    else:
        for lim in limits:
            print(f"{lim['scope']}  {lim['name']}  {lim['running']}/{lim['max_running']} running")
    return 0


def cmd_pause_resume(args: argparse.Namespace) -> int:
    from gpuq import admin

    if args.command == "pause":
        changed = on_db(args, lambda conn: admin.pause(conn, args.kind, by=getpass.getuser()))
    else:
        changed = on_db(args, lambda conn: admin.resume(conn, args.kind))
    admin_event(args.command, kind=args.kind, changed=changed)
    pausing = args.command == "pause"
    if changed:
        print(f"{args.kind}: {'paused' if pausing else 'resumed'}")
    else:
        print(f"{args.kind}: {'already paused' if pausing else 'was not paused'}")
    return 0


def cmd_retry(args: argparse.Namespace) -> int:
    from gpuq import admin
    from gpuq.jobs import RetryFilter

    which = RetryFilter(ids=args.ids or None, kind=args.kind, error=args.error, since=args.since,
                              until=args.until, state=args.state, key=args.key)
    which.args()  # no criterion at all is an error, before connecting

    n = on_db(args, lambda conn: admin.retry_count(conn, which) if args.dry_run else admin.retry(conn, which, args.fresh))
    if args.dry_run:
        print(f"{n} dead or cancelled job(s) would go back to pending (dry run: nothing changed)")
        return 0
    admin_event("retry", jobs=n, ids=args.ids or None, kind=args.kind, error=args.error, state=args.state,
                key=args.key, fresh=args.fresh, since=args.since and args.since.isoformat(), until=args.until and args.until.isoformat())
    print(f"{n} dead or cancelled job(s) sent back to pending")
    return 0
