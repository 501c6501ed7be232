"""The database a command works on: ``DATABASE_URL`` (or ``--database-url``), through the pooler
mode the flags or environment say, one connection per command."""

from __future__ import annotations

import argparse
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import anyio

from gpuq import config
from gpuq.cli.errors import CLIError

T = TypeVar("T")


def dsn(args: argparse.Namespace) -> str:
    found = config.get("database_url", flag=getattr(args, "database_url", None))
    if not found:
        raise CLIError("no database: set DATABASE_URL or --database-url (or run `gpuq dev`)")
    return found


def pooled(args: argparse.Namespace) -> bool:
    """Whether the command goes through a transaction pooler (no session kept between statements)."""
    return config.get("pooler", flag=args.pooler) == "transaction"


async def connect(args: argparse.Namespace) -> Any:
    """A connection to DATABASE_URL, through the pooler mode the flags or environment say."""
    from gpuq import db

    return await db.connect(dsn(args), pooler=pooled(args))


def on_db(args: argparse.Namespace, call: Callable[[Any], Awaitable[T]]) -> T:
    """``call(conn)`` on a connection to the command's database, closed afterwards."""

    async def run() -> T:
        from gpuq import db

        conn = await connect(args)
        try:
            return await call(conn)
        finally:
            await db.close(conn)

    return anyio.run(run)
