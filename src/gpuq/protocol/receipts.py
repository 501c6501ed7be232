"""What ``job.checkpoint()`` returns: a ``Receipt``, resolved once the server has answered. No I/O:
an async handler awaits it, a sync one waits on it in its thread; any thread resolves it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Generator
from typing import Any

__all__ = ["Receipt"]


class Receipt:
    """Whether one ``job.checkpoint()`` is stored: ``await receipt`` (async handlers) or
    ``receipt.wait()`` (sync ones) gives True once the server committed it, or a later checkpoint
    of the same job that replaced it, and False when it was not stored: the job's lease was lost
    (fencing), the connection dropped first, or the server does not take checkpoints. Not
    waiting is fine: the checkpoint goes out all the same."""

    __slots__ = ("_event", "_futures", "_lock", "_stored")

    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._stored: bool | None = None
        self._futures: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[bool]]] = []

    @classmethod
    def resolved(cls, stored: bool) -> Receipt:
        receipt = cls()
        receipt.resolve(stored)
        return receipt

    @property
    def stored(self) -> bool | None:
        """True: stored; False: not stored; None: no answer yet."""
        return self._stored

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool | None:
        """Block this thread until the answer (a sync handler); None if ``timeout`` passed first.
        ``RuntimeError`` on an event loop's thread, which the answer needs: ``await`` it there."""
        if not self._event.is_set() and _on_a_loop():
            raise RuntimeError("Receipt.wait() would block the event loop the answer comes through: "
                               "await the receipt in an async handler")
        self._event.wait(timeout)
        return self._stored

    def __await__(self) -> Generator[Any, None, bool]:
        return self._wait().__await__()

    async def _wait(self) -> bool:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[bool] = loop.create_future()
        with self._lock:
            if self._stored is None:
                self._futures.append((loop, future))
        if self._stored is not None:
            return self._stored
        return await future

    def resolve(self, stored: bool) -> None:
        """The answer (the first one counts), to every waiter, from any thread."""
        with self._lock:
            if self._stored is not None:
                return
            self._stored = stored
            futures, self._futures = self._futures, []
        self._event.set()
        for loop, future in futures:
            try:
                loop.call_soon_threadsafe(_set, future, stored)
            except RuntimeError:  # its loop has closed: nobody waits there any more
                pass


def _set(future: asyncio.Future[bool], stored: bool) -> None:
    if not future.done():  # a waiter that was cancelled
        future.set_result(stored)


def _on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True
