"""The event loop of the long-running commands (serve, sweep, agent, dev)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import anyio

from gpuq import config
from gpuq.config import ConfigError


def use_uvloop(env: Mapping[str, str] | None = None) -> bool:
    """``GPUQ_EVENT_LOOP``: uvloop (the default where it is installed) or asyncio's own loop.

    ``asyncio`` is there for debugging and odd platforms; docs/benchmarks.md
    has what uvloop saves.
    """
    choice = config.get("event_loop", env)
    if choice == "asyncio":
        return False
    try:
        import uvloop  # noqa: F401
    except ImportError:
        if choice == "uvloop":
            raise ConfigError("GPUQ_EVENT_LOOP=uvloop but uvloop is not installed "
                              "(pip install uvloop)") from None
        return False
    return True


def run_service(fn: Callable[..., Any], *args: Any) -> Any:
    """``anyio.run`` on the loop ``GPUQ_EVENT_LOOP`` picks."""
    return anyio.run(fn, *args, backend_options={"use_uvloop": use_uvloop()})
