"""The ``gpuq`` command: migrate, serve, sweep, agent, enqueue, status, jobs, show, wait, cancel, pause, resume,
retry, schedule, kind-timeout, limit, dev, bench.

Every failure an operator can cause (bad flag, unreachable database, missing
migrations, bad handler path) ends in one ``gpuq: error: ...`` line and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import getpass
import importlib
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from datetime import datetime
from typing import Any, TypeVar

import anyio

from gpuq import __version__, config, logs
from gpuq.runtime import run_service
from gpuq.signals import stop_on_signal

T = TypeVar("T")
EXIT_USAGE = 2
EXIT_FAILURE = 1


class CLIError(Exception):
    """One line for the operator, then exit non-zero."""


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser, so nothing else loads the bench modules
        return _run(cmd_bench, argv[1:])
    return _run(_command, build_parser().parse_args(argv))


def _command(args: argparse.Namespace) -> int:
    if getattr(args, "log_format", None) is not None or args.command in LOGGING_COMMANDS:
        logs.configure(getattr(args, "log_format", None), getattr(args, "log_level", None),
                       stream=sys.stderr if args.command in STDERR_LOG_COMMANDS else sys.stdout)
    return int(args.func(args) or 0)


def _run(command: Callable[[Any], int], arg: Any) -> int:
    """Run a command; every failure an operator can cause becomes one line and exit 1."""
    try:
        return int(command(arg) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's one place that turns errors into a line
        message = _known_error(exc)
        if message is None:
            raise
        print(f"gpuq: error: {message}", file=sys.stderr)
        return EXIT_FAILURE


LOGGING_COMMANDS = set(config.LOGGED)
STDERR_LOG_COMMANDS = {"dev"}  # dev prints progress on stdout


def _known_error(exc: BaseException) -> str | None:
    from gpuq.config import ConfigError
    from gpuq.db import DatabaseUnavailable
    from gpuq.devdb import DevDBError
    from gpuq.migrate import MigrationError

    if isinstance(exc, ConfigError | DatabaseUnavailable | DevDBError | MigrationError | CLIError | ValueError):
        return str(exc)
    try:
        from gpuq.agent import AuthError

        if isinstance(exc, AuthError):
            return str(exc)
    except ImportError:  # pragma: no cover
        pass
    import asyncpg

    if isinstance(exc, asyncpg.PostgresError):
        return f"database error: {exc}"
    if isinstance(exc, OSError):
        return str(exc)
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _known_error(exc.exceptions[0])
    return None


# --------------------------------------------------------------------------
# Parser
# --------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuq", description="Event-driven GPU job queue on PostgreSQL.")
    p.add_argument("--version", action="version", version=f"gpuq {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    m = sub.add_parser("migrate", help="apply database migrations (safe to run concurrently)")
    config.add_flags(m, "migrate")
    m.set_defaults(func=cmd_migrate)

    s = sub.add_parser("serve", help="run the dispatcher, maintenance services and agent server")
    config.add_flags(s, "serve")
    s.set_defaults(func=cmd_serve)

    w = sub.add_parser("sweep", help="run only the maintenance services (reclaim expired leases, "
                       "promote retries, retention)")
    config.add_flags(w, "sweep")
    w.add_argument("--once", action="store_true", help="run each service once, print what it did, exit")
    w.set_defaults(func=cmd_sweep)

    a = sub.add_parser("agent", help="run an agent that executes jobs with a handler")
    config.add_flags(a, "agent")
    a.add_argument("--ca-file", help="CA bundle to verify a wss:// server")
    a.set_defaults(func=cmd_agent)

    e = sub.add_parser("enqueue", help="enqueue a job, or JSON lines from stdin with --stdin")
    e.add_argument("kind", nargs="?", help="job kind (routing key)")
    e.add_argument("payload", nargs="?", default="{}", help="JSON payload (default {})")
    e.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    e.add_argument("--max-attempts", type=int, default=5, help="attempts before dead (default 5)")
    e.add_argument("--delay", type=float, default=0.0, help="seconds before the job may run")
    e.add_argument("--dedup-key", help="skip if a live job has this key (prints the live job's id)")
    e.add_argument("--timeout", type=int, default=None,
                   help="seconds one attempt may run; then it fails with 'timeout' (default: no limit)")
    e.add_argument("--gpus", type=int, default=0, help="GPUs the job takes, on one agent (default 0)")
    e.add_argument("--gpu-memory", type=int, default=None, metavar="MIB",
                   help="the least memory of each of those GPUs, MiB")
    e.add_argument("--labels", default="", help="comma-separated labels the agent must have (gpu=h100,...)")
    e.add_argument("--model", default=None, help="the model it would rather find warm on its agent")
    e.add_argument("--concurrency-key", default=None, help="what global limits count it under (a tenant, ...)")
    e.add_argument("--stdin", action="store_true",
                   help='bulk: one JSON object per line, {"kind": ..., "payload": ..., "priority": ...}; '
                        "the flags' names (gpus, gpu_memory_mb, labels, model, concurrency_key) too")
    e.add_argument("--batch", type=int, default=1000, help="rows per INSERT with --stdin (default 1000)")
    config.add_flags(e, "enqueue")
    e.set_defaults(func=cmd_enqueue)

    t = sub.add_parser("status", help="live job counts per kind and state (never scans history)")
    config.add_flags(t, "status")
    t.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t.add_argument("--server", help="also show connected agents, from a server's /status (http://host:port)")
    t.set_defaults(func=cmd_status)

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

    c = sub.add_parser("cancel", help="cancel jobs, pending or running: they end cancelled and are not retried")
    c.add_argument("ids", metavar="ID", type=int, nargs="+")
    config.add_flags(c, "cancel")
    c.set_defaults(func=cmd_cancel)

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

    r = sub.add_parser("retry", help="send dead or cancelled jobs back to pending with fresh attempts, "
                                     "by id or by filter")
    r.add_argument("ids", metavar="ID", type=int, nargs="*", help="job ids (or use the filters)")
    r.add_argument("--kind", help="only jobs of this kind")
    r.add_argument("--error", help="only jobs whose last error contains this text")
    r.add_argument("--since", type=_timestamp, help="only jobs that ended at or after this time (ISO 8601)")
    r.add_argument("--until", type=_timestamp, help="only jobs that ended before this time (ISO 8601)")
    r.add_argument("--state", choices=("dead", "cancelled"), help="only dead or only cancelled jobs (default: both)")
    r.add_argument("--key", help="only jobs with this concurrency key")
    r.add_argument("--dry-run", action="store_true", help="print how many would go, change nothing")
    config.add_flags(r, "retry")
    r.set_defaults(func=cmd_retry)

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

    d = sub.add_parser("dev", help="everything on an embedded PostgreSQL under .gpuq/: server, demo agents, "
                       "a producer, live progress")
    d.add_argument("--agents", type=int, default=3, help="demo agents (default 3)")
    d.add_argument("--capacity", type=int, default=4, help="capacity of each demo agent (default 4)")
    d.add_argument("--rate", type=float, default=50.0, help="jobs enqueued per second (default 50)")
    d.add_argument("--job-seconds", type=float, default=0.05, help="simulated GPU time per job (default 0.05)")
    d.add_argument("--duration", type=float, help="stop after this many seconds (default: until Ctrl-C)")
    d.add_argument("--data-dir", default=".gpuq", help="where the embedded cluster lives (default .gpuq)")
    d.add_argument("--port", type=int, default=8765, help="server port (default 8765; 0 = any free port)")
    config.add_flags(d, "dev")
    d.set_defaults(func=cmd_dev)

    # Parsed by gpuq.bench.main (see main()); listed here for --help only.
    sub.add_parser("bench", help="benchmarks: `gpuq bench --help` lists them (see docs/benchmarks.md)",
                   add_help=False)
    return p


def cmd_bench(argv: list[str]) -> int:
    try:
        from gpuq import bench
    except ImportError as exc:  # an install without the bench extra
        raise CLIError(f"benchmarks unavailable: {exc} (pip install 'gpuq[bench]')") from None
    return bench.main(argv)


async def _connect(args: argparse.Namespace) -> Any:
    """A connection to DATABASE_URL, through the pooler mode the flags or environment say."""
    from gpuq import db

    return await db.connect(_dsn(args), pooler=config.get("pooler", flag=args.pooler) == "transaction")


def _on_db(args: argparse.Namespace, call: Callable[[Any], Awaitable[T]]) -> T:
    """``call(conn)`` on a connection to the command's database, closed afterwards."""

    async def run() -> T:
        conn = await _connect(args)
        try:
            return await call(conn)
        finally:
            await conn.close()

    return anyio.run(run)


def _dsn(args: argparse.Namespace) -> str:
    dsn = config.get("database_url", flag=getattr(args, "database_url", None))
    if not dsn:
        raise CLIError("no database: set DATABASE_URL or --database-url (or run `gpuq dev`)")
    return dsn


# --------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------


def cmd_migrate(args: argparse.Namespace) -> int:
    from gpuq.migrate import migrate

    direct = config.get("direct_url", flag=args.direct_url)
    if direct is None and config.get("pooler", flag=args.pooler) == "transaction":
        raise CLIError("gpuq migrate needs a session, which a transaction pooler does not keep: "
                       "set GPUQ_DIRECT_URL (or --direct-url) to the server itself")
    applied = anyio.run(migrate, direct or _dsn(args))
    print(f"applied {', '.join(applied)}" if applied else "up to date")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from gpuq.server import serve, ssl_context

    server_config = config.ServerConfig.from_env(flags=config.flag_values(args, "serve"))
    tls = ssl_context(config.get("tls_cert", flag=args.tls_cert), config.get("tls_key", flag=args.tls_key))

    async def run() -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(stop_on_signal, stop.set)
            await serve(server_config, stop=stop, tls=tls)
            tg.cancel_scope.cancel()

    run_service(run)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from gpuq import db
    from gpuq.maintenance import Maintainer

    interval = config.get("sweep_seconds", flag=args.sweep_seconds)
    retention = config.get("retention_seconds", flag=args.retention_seconds)

    async def run() -> None:
        pool = await db.create_pool(_dsn(args), min_size=1, max_size=2,
                                    pooler=config.get("pooler", flag=args.pooler) == "transaction")
        try:
            maintainer = Maintainer.standard(pool, interval, retention)
            if args.once:
                r = await maintainer.run_once()
                print(json.dumps({k: r[k] for k in ("reclaimed", "dead", "promoted", "schedules_fired", "timed_out", "pruned")}))
                return
            stop = anyio.Event()
            async with anyio.create_task_group() as tg:
                tg.start_soon(stop_on_signal, stop.set)
                tg.start_soon(maintainer.run)
                await stop.wait()
                tg.cancel_scope.cancel()
        finally:
            await pool.close()

    run_service(run)
    return 0


def cmd_agent(args: argparse.Namespace) -> int:
    from gpuq.agent import Agent
    from gpuq.gpus import parse_devices
    from gpuq.protocol import ProtocolError

    token, kinds = config.get("token", flag=args.token), config.get("kinds", flag=args.kinds)
    if not token:
        raise CLIError("no token: set GPUQ_TOKEN or --token")
    if not kinds:
        raise CLIError("no kinds: set GPUQ_KINDS or --kinds (comma-separated)")
    handler = load_handler(config.get("handler", flag=args.handler))
    ctx = None
    if args.ca_file:
        import ssl

        ctx = ssl.create_default_context(cafile=args.ca_file)
    try:
        devices = parse_devices(config.get("devices", flag=args.devices))
    except ValueError as exc:
        raise CLIError(f"--devices: {exc}") from None
    try:
        agent = Agent(config.get("url", flag=args.url), token, kinds, config.get("capacity", flag=args.capacity),
                      handler, config.get("agent_name", flag=args.agent_name), ssl_context=ctx, devices=devices,
                      labels=config.get("labels", flag=args.labels), models=config.get("models", flag=args.models),
                      prefetch=config.get("prefetch", flag=args.prefetch))
    except ProtocolError as exc:
        raise CLIError(exc.message) from None
    run_service(agent.run_until_signal)
    return 0


def load_handler(spec: str) -> Callable[..., Any]:
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CLIError(f"handler {spec!r} must look like module:function")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CLIError(f"cannot import handler module {module_name!r}: {exc}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise CLIError(f"{spec!r}: {module_name} has no callable {attr!r}")
    return fn  # type: ignore[no-any-return]


def cmd_enqueue(args: argparse.Namespace) -> int:
    from gpuq import queue
    from gpuq.jobs import NewJob

    if args.stdin:
        if args.kind:
            raise CLIError("give either a kind and payload, or --stdin, not both")
        return _enqueue_stdin(args)
    if not args.kind:
        raise CLIError("missing job kind (or use --stdin)")
    try:
        job = NewJob.from_mapping({
            "kind": args.kind, "payload": _json_arg(args.payload, "payload"), "priority": args.priority,
            "max_attempts": args.max_attempts, "delay": args.delay, "dedup_key": args.dedup_key,
            "timeout": args.timeout, "gpus": args.gpus, "gpu_memory_mb": args.gpu_memory,
            "labels": config.parse_list(args.labels, "--labels"), "model": args.model,
            "concurrency_key": args.concurrency_key})
    except ValueError as exc:
        raise CLIError(str(exc)) from None

    print(_on_db(args, lambda conn: queue.enqueue_many(conn, [job]))[0])
    return 0


def _enqueue_stdin(args: argparse.Namespace) -> int:
    from gpuq import queue
    from gpuq.jobs import NewJob

    def parse(lineno: int, line: str) -> NewJob:
        try:
            return NewJob.from_mapping(_json_arg(line, f"stdin line {lineno}"))
        except ValueError as exc:
            raise CLIError(f"stdin line {lineno}: {exc}") from None

    async def run(conn: Any) -> int:
        total, batch = 0, []
        for lineno, line in enumerate(sys.stdin, 1):
            if line.strip():
                batch.append(parse(lineno, line))
            if len(batch) >= args.batch:
                total += len(await queue.enqueue_many(conn, batch))
                batch = []
                print(f"enqueued {total}", file=sys.stderr)
        if batch:
            total += len(await queue.enqueue_many(conn, batch))
        return total

    print(f"enqueued {_on_db(args, run)} jobs")
    return 0


def _json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CLIError(f"{what} is not valid JSON: {exc}") from None


def cmd_status(args: argparse.Namespace) -> int:
    from gpuq import admin

    body = _on_db(args, admin.status_counts).as_dict()
    if args.server:
        body["server"] = _fetch_server_status(args.server)
    if args.json:
        print(json.dumps(body, indent=2, default=str))
    else:
        print(render_status(body))
    return 0


def _timestamp(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None
    return value if value.tzinfo else value.astimezone()  # no zone given: local time


def _admin(action: str, **fields: Any) -> None:
    """Every admin action is a structured event on stderr naming who did it."""
    logs.configure(stream=sys.stderr)
    logs.get("admin").info(f"admin.{action}", by=getpass.getuser(), **fields)


def cmd_show(args: argparse.Namespace) -> int:
    from gpuq import admin

    async def read(conn: Any) -> dict[str, Any] | None:
        found = await admin.show(conn, args.id)
        if found is not None:  # each attempt that did not succeed (the last one is the row itself)
            found["failed_attempts"] = await admin.attempts(conn, args.id)
        return found

    found = _on_db(args, read)
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
    page = _on_db(args, lambda conn: admin.list_jobs(conn, which, args.before, args.limit))
    if args.json:
        print(json.dumps({"jobs": page.jobs, "older": page.older, "searched_to": page.searched_to}, default=str))
        return 0
    rows: list[tuple[str, ...]] = [("id", "kind", "state", "attempts", "created", "error")]
    rows += [(str(j["id"]), j["kind"], j["status"], f"{j['attempts']}/{j['max_attempts']}",
              j["created_at"].strftime("%Y-%m-%d %H:%M:%S"), error_line(j["error"])[:60])
             for j in page.jobs]
    print("\n".join(_table(rows, right={0, 3})))
    if page.searched_to:
        print(f"(looked at ids from {page.searched_to} up)")
    if page.older:
        print(f"older: gpuq jobs ... --before {page.older}")
    return 0


def _table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    """Rows as aligned text lines; the columns in ``right`` flush right (numbers)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            .rstrip() for r in rows]


def cmd_wait(args: argparse.Namespace) -> int:
    from gpuq.producer import JobError, wait

    def show_progress(progress: dict[str, Any]) -> None:
        print(json.dumps(progress), file=sys.stderr, flush=True)

    on_progress = show_progress if args.progress else None
    try:
        result = _on_db(args, lambda conn: wait(conn, args.id, args.timeout, on_progress=on_progress))
    except JobError as exc:
        raise CLIError(str(exc)) from None
    print(json.dumps(result))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    """Cancel each id; one line per id. Exit 1 if any was not live (finished or unknown)."""
    from gpuq import admin

    cancelled = _on_db(args, lambda conn: admin.cancel(conn, *args.ids))
    _admin("cancel", ids=args.ids, cancelled=sorted(cancelled))
    for job_id in args.ids:
        was = cancelled.get(job_id)
        print(f"{job_id}: cancelled (was {was})" if was else f"{job_id}: not live (finished, or no such job)")
    return 0 if len(cancelled) == len(set(args.ids)) else EXIT_FAILURE


def cmd_schedule(args: argparse.Namespace) -> int:
    from gpuq import schedules

    if args.action == "add":
        schedule = schedules.Schedule(args.name, args.cron, args.kind, _json_arg(args.payload, "--payload"),
                                      args.priority, args.max_attempts)
        got: Any = _on_db(args, lambda conn: schedules.add(conn, schedule, by=getpass.getuser()))
    elif args.action == "remove":
        got = _on_db(args, lambda conn: schedules.remove(conn, args.name))
    else:
        got = _on_db(args, schedules.listing)
    if args.action == "list":
        if args.json:
            print(json.dumps(got, indent=2, default=str))
        for s in [] if args.json else got:
            print(f"{s['name']}  {s['cron']!r}  kind={s['kind']}  next={s['next_run_at'].isoformat()}")
        return 0
    _admin(f"schedule_{args.action}", name=args.name, **({"cron": args.cron, "kind": args.kind}
                                                         if args.action == "add" else {"removed": got}))
    if args.action == "add":
        print(f"{args.name}: first run at {got.isoformat()}")
        return 0
    print(f"{args.name}: removed" if got else f"{args.name}: no such schedule")
    return 0 if got else EXIT_FAILURE


def cmd_kind_timeout(args: argparse.Namespace) -> int:
    from gpuq import admin

    if args.kind is not None and args.seconds is None:
        raise CLIError("give SECONDS (or none) after the kind; no arguments lists the defaults")
    seconds = None
    if args.seconds not in (None, "none"):
        try:
            seconds = int(args.seconds)
        except ValueError:
            raise CLIError(f"timeout must be whole seconds or none, not {args.seconds!r}") from None

    async def run(conn: Any) -> dict[str, int]:
        if args.kind is not None:
            await admin.set_kind_timeout(conn, args.kind, seconds)
        return await admin.kind_timeouts(conn)

    defaults = _on_db(args, run)
    if args.kind is not None:
        _admin("kind_timeout", kind=args.kind, seconds=seconds)
        print(f"{args.kind}: default timeout {f'{seconds} s' if seconds else 'none'}")
    else:
        for kind, value in defaults.items():
            print(f"{kind}  {value} s")
    return 0


def cmd_limit(args: argparse.Namespace) -> int:
    from gpuq import admin

    if args.scope is not None and args.max_running is None:
        raise CLIError("give NAME and N (or none): gpuq limit kind|key NAME N|none; no arguments lists them")
    limit = None
    if args.max_running not in (None, "none"):
        try:
            limit = int(args.max_running)
        except ValueError:
            raise CLIError(f"a limit is a whole number of jobs or none, not {args.max_running!r}") from None

    async def run(conn: Any) -> list[dict[str, Any]]:
        if args.scope is not None:
            try:
                await admin.set_limit(conn, args.scope, args.name, limit)
            except ValueError as exc:
                raise CLIError(str(exc)) from None
        return await admin.limits(conn)

    limits = _on_db(args, run)
    if args.scope is not None:
        _admin("limit", scope=args.scope, name=args.name, max_running=limit)
        print(f"{args.scope} {args.name}: {'at most ' + str(limit) + ' running' if limit is not None else 'no limit'}")
    else:
        for lim in limits:
            print(f"{lim['scope']}  {lim['name']}  {lim['running']}/{lim['max_running']} running")
    return 0


def cmd_pause_resume(args: argparse.Namespace) -> int:
    from gpuq import admin

    if args.command == "pause":
        changed = _on_db(args, lambda conn: admin.pause(conn, args.kind, by=getpass.getuser()))
    else:
        changed = _on_db(args, lambda conn: admin.resume(conn, args.kind))
    _admin(args.command, kind=args.kind, changed=changed)
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

    n = _on_db(args, lambda conn: (admin.retry_count if args.dry_run else admin.retry)(conn, which))
    if args.dry_run:
        print(f"{n} dead or cancelled job(s) would go back to pending (dry run: nothing changed)")
        return 0
    _admin("retry", jobs=n, ids=args.ids or None, kind=args.kind, error=args.error, state=args.state, key=args.key,
           since=args.since and args.since.isoformat(), until=args.until and args.until.isoformat())
    print(f"{n} dead or cancelled job(s) sent back to pending")
    return 0


def _fetch_server_status(base: str) -> dict[str, Any]:
    import urllib.request

    url = base.rstrip("/") + "/status"
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 - operator-given http(s) URL
            return dict(json.load(resp))
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot read {url}: {exc}") from None


def render_status(body: dict[str, Any]) -> str:
    live = body["live"]
    kinds = sorted({k for by_kind in live.values() for k in by_kind})
    rows: list[tuple[str, ...]] = [("kind", "pending", "leased", "scheduled")]
    rows += [(k, *(str(live[s].get(k, 0)) for s in ("pending", "leased", "scheduled"))) for k in kinds]
    rows.append(("total", *(str(body["totals"][s]) for s in ("pending", "leased", "scheduled"))))
    lines = _table(rows, right={1, 2, 3})
    for kind, shapes in sorted(body.get("server", {}).get("unplaceable", {}).items()):
        for u in shapes:
            lines.append(f"unplaceable: {kind}: {u['pending']} pending ({u['reason']})")
    for kind, p in sorted(body.get("paused", {}).items()):
        lines.append(f"paused: {kind} (by {p['by']} since {p['since']})")
    oldest = body["oldest_pending_seconds"]
    lines.append(f"oldest pending: {oldest:.1f} s" if oldest is not None else "oldest pending: -")
    lines.append(f"history (done+dead, estimate): {body['history_estimate']}")
    if "server" in body:
        lines.append(f"agents connected: {body['server'].get('agents_connected', 0)}")
        for a in body["server"].get("agents", []):
            lines.append(f"  {a['agent']}  kinds={','.join(a['kinds'])}  inflight={a['inflight']}/{a['capacity']}"
                         f"  protocol={a.get('protocol', '?')}")
            if a.get("labels") or a.get("models"):
                lines.append(f"    labels: {', '.join(a.get('labels', [])) or '-'}"
                             f"  models: {', '.join(a.get('models', [])) or '-'}")
            for d in a.get("devices", []):
                usage = "" if d["utilization"] is None else \
                    f"  util {d['utilization']}%  used {d['memory_used_mb']} MiB"
                lines.append(f"    gpu {d['index']}: {d['name']} {d['memory_mb']} MiB{usage}")
            for job_id, p in sorted(a.get("progress", {}).items(), key=lambda item: int(item[0])):
                lines.append(f"    job {job_id}: {p['fraction']:.0%}" + (f" {p['message']}" if p["message"] else ""))
    return "\n".join(lines)


def cmd_dev(args: argparse.Namespace) -> int:
    from gpuq.devrun import run_dev

    return run_dev(args)


if __name__ == "__main__":
    sys.exit(main())
