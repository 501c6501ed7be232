"""A TCP proxy on 127.0.0.1 that can become a black hole, for tests and ``gpuq bench failover``.

A peer that vanishes behind a hung proxy, a frozen VM or a partition does not
close its sockets: the kernel keeps accepting and acknowledging, and nothing
comes back. ``black_hole()`` does that to every connection through the proxy,
open or new: bytes are taken and never passed on, and nothing is closed.
``forward()`` passes them on again. The proxy runs its own event loop in a
thread, so it serves subprocesses and the caller's own loop alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from typing import Any

CHUNK = 65536


class TcpProxy:
    def __init__(self, target_port: int, target_host: str = "127.0.0.1"):
        self.target = (target_host, target_port)
        self.port = 0
        self.accepted = 0  # connections taken, black hole or not
        self._loop = asyncio.new_event_loop()
        self._open = asyncio.Event()
        self._open.set()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._closing = False
        self._thread = threading.Thread(target=self._loop.run_forever, name="tcpproxy", daemon=True)

    def __enter__(self) -> TcpProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> TcpProxy:
        self._thread.start()
        self._call(self._listen())
        return self

    def black_hole(self) -> None:
        """Stop passing bytes on, either way, on every connection; close none."""
        self._loop.call_soon_threadsafe(self._open.clear)

    def forward(self) -> None:
        """Pass bytes on again (what was held back goes first)."""
        self._loop.call_soon_threadsafe(self._open.set)

    def close(self) -> None:
        """Stop listening and close every connection through the proxy."""
        if self._thread.is_alive():
            self._call(self._shut())
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
            if not self._thread.is_alive():
                self._loop.close()

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(10)

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def _shut(self) -> None:
        assert self._server is not None
        self._server.close()
        self._closing = True
        for w in list(self._writers):
            w.transport.abort()
        self._open.set()  # pumps held back see their sockets gone and end
        # Connections still opening upstream end here, not when the collector finds them
        # after the loop is gone (their cleanup then raised into whatever ran at the time).
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)

    async def _accept(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        # Cancelled by close(), it returns: asyncio 3.11's stream callback calls exception() on the
        # task, which raises for a cancelled one and printed a traceback per connection.
        with contextlib.suppress(asyncio.CancelledError):
            await self._relay(client_r, client_w)

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._writers.add(client_w)
        self.accepted += 1
        try:
            await self._open.wait()  # a black hole accepts, and then says nothing
            if self._closing:
                return
            try:
                upstream_r, upstream_w = await asyncio.open_connection(*self.target)
            except OSError:
                return
            self._writers.add(upstream_w)
            try:
                await asyncio.gather(self._pump(client_r, upstream_w), self._pump(upstream_r, client_w))
            finally:
                self._writers.discard(upstream_w)
                upstream_w.transport.abort()
        finally:
            self._writers.discard(client_w)
            client_w.transport.abort()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(CHUNK):
                await self._open.wait()
                if writer.transport.is_closing():
                    return
                writer.write(data)
                await writer.drain()
        writer.transport.abort()  # one side closed: so does the other, as a plain proxy does
