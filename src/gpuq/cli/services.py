"""The commands that run the queue's processes: ``migrate`` (the schema), ``serve`` (dispatcher,
maintenance and agent server), ``sweep`` (only the maintenance services)."""

from __future__ import annotations

import argparse
import json

import anyio

from gpuq import config
from gpuq.cli.database import dsn, pooled
from gpuq.cli.errors import CLIError
from gpuq.runtime import run_service
from gpuq.signals import stop_on_signal


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
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


def cmd_migrate(args: argparse.Namespace) -> int:
    from gpuq.migrate import migrate

    direct = config.get("direct_url", flag=args.direct_url)
    if direct is None and pooled(args):
        raise CLIError("gpuq migrate needs a session, which a transaction pooler does not keep: "
                       "set GPUQ_DIRECT_URL (or --direct-url) to the server itself")
    applied = anyio.run(migrate, direct or dsn(args))
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
            await serve(server_config, stop=stop, tls=tls, freeze_startup=True)
            tg.cancel_scope.cancel()

    run_service(run)
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    from gpuq import db
    from gpuq.dispatcher.tuning import TUNING_DEFAULT
    from gpuq.maintenance import Maintainer

    interval = config.get("sweep_seconds", flag=args.sweep_seconds)
    retention = config.get("retention_seconds", flag=args.retention_seconds)

    async def run() -> None:
        pool = await db.create_pool(dsn(args), min_size=1, max_size=2, pooler=pooled(args))
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
            await db.close_pool(pool, TUNING_DEFAULT.shutdown_db_seconds)

    run_service(run)
    return 0
