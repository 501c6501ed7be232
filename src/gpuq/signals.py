"""SIGTERM and SIGINT as a graceful stop: the one watcher every long-running command uses."""

from __future__ import annotations

import signal
from collections.abc import Callable

import anyio


async def stop_on_signal(*stops: Callable[[], object]) -> None:
    """Wait for SIGTERM or SIGINT, call each of ``stops`` once, return."""
    with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            for stop in stops:
                stop()
            return
