"""structlog setup: one JSON object per line, or console rendering on a terminal.

Every job event carries its ids as keys (``job_id``, ``agent``, ``kind``,
``batch``) so ops can filter with ``jq``; the event name is dotted,
``<subject>.<what happened>``, such as ``job.done``, ``lease.batch`` or
``agent.connected``.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

from gpuq import config

_level = logging.NOTSET  # unconfigured structlog prints every level


def configure(fmt: str | None = None, level: str | None = None, stream: Any = None) -> None:
    """Configure structlog for the process (``GPUQ_LOG_FORMAT``, ``GPUQ_LOG_LEVEL``)."""
    fmt = config.get("log_format", flag=fmt)
    level_name = config.get("log_level", flag=level).upper()
    numeric = logging.getLevelName(level_name)
    global _level
    _level = numeric
    stream = stream or sys.stdout
    if fmt == "auto":
        fmt = "console" if getattr(stream, "isatty", lambda: False)() else "json"
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=True)
        if fmt == "console"
        else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=False,
    )


def debug_enabled() -> bool:
    """Whether DEBUG lines are printed: ask once per batch before logging each job of it."""
    return _level <= logging.DEBUG


def get(name: str) -> Any:
    """A logger whose events all carry ``component=name``.

    A lazy proxy: it follows ``configure()`` even when created at import time.
    """
    return structlog.get_logger(component=name)


def event_loop_name() -> str:
    """The running event loop's package, ``uvloop`` or ``asyncio`` (logged at startup)."""
    import asyncio

    return type(asyncio.get_running_loop()).__module__.split(".")[0]
