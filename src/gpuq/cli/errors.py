"""How a command fails: one ``gpuq: error: ...`` line and exit 1 for every failure an operator can
cause (bad flag, unreachable database, missing migrations, bad handler path), never a traceback."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

EXIT_USAGE = 2
EXIT_FAILURE = 1


class CLIError(Exception):
    """One line for the operator, then exit non-zero."""


def run_guarded(command: Callable[[Any], int], arg: Any) -> int:
    """Run a command; every failure an operator can cause becomes one line and exit 1."""
    try:
        return int(command(arg) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - the CLI's one place that turns errors into a line
        message = known_error(exc)
        if message is None:
            raise
        print(f"gpuq: error: {message}", file=sys.stderr)
        return EXIT_FAILURE


def known_error(exc: BaseException) -> str | None:
    """The line to print for a failure the operator can cause; None for a bug (a traceback)."""
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
        return known_error(exc.exceptions[0])
    return None
