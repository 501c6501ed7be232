"""One operator with the dashboard open, for ``gpuq bench throughput --dashboard``.

It logs in, keeps the overview's live socket open (a fragment a second when
it changes) and reloads the overview, agents and jobs pages every
``RELOAD_SECONDS``, as someone watching a run would.
"""

from __future__ import annotations

import contextlib
import http.client
from collections.abc import AsyncIterator
from typing import Any

import anyio
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

TOKEN = "bench-dashboard-token"
RELOAD_SECONDS = 2.0
PAGES = ("/ui", "/ui/agents", "/ui/jobs", "/ui/jobs?state=leased")


def _http(port: int, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str]]:
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        c.request(method, path, headers=headers)
        r = c.getresponse()
        r.read()
        return r.status, {k.lower(): v for k, v in r.getheaders()}
    finally:
        c.close()


@contextlib.asynccontextmanager
async def dashboard_open(port: int, token: str = TOKEN) -> AsyncIterator[dict[str, int]]:
    """While inside: one logged-in dashboard client on serve's ``port``; yields what it received."""
    origin = f"http://127.0.0.1:{port}"
    status, headers = await anyio.to_thread.run_sync(
        _http, port, "POST", "/ui/login", {"Authorization": f"Bearer {token}", "Origin": origin})
    if status != 204:
        raise RuntimeError(f"dashboard login refused ({status}): is serve run with --ui-tokens?")
    cookie = headers["set-cookie"].split(";")[0]
    seen = {"fragments": 0, "pages": 0}

    async def live() -> None:
        async with connect(f"ws://127.0.0.1:{port}/ui/live?page=overview", origin=origin,  # type: ignore[arg-type]
                           additional_headers={"Cookie": cookie}) as ws:
            with contextlib.suppress(ConnectionClosed):
                async for _ in ws:
                    seen["fragments"] += 1

    async def reload() -> None:
        while True:
            for page in PAGES:
                status, _ = await anyio.to_thread.run_sync(_http, port, "GET", page, {"Cookie": cookie})
                if status != 200:
                    raise RuntimeError(f"dashboard page {page}: HTTP {status}")
                seen["pages"] += 1
            await anyio.sleep(RELOAD_SECONDS)

    async with anyio.create_task_group() as tg:
        tg.start_soon(live)
        tg.start_soon(reload)
        try:
            yield seen
        finally:
            tg.cancel_scope.cancel()


def serve_flags() -> dict[str, Any]:
    return {"ui_tokens": TOKEN}
