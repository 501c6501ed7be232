"""The dashboard's HTTP side at /ui, on the serve's own port: pages, login, static files, live updates.

``gpuq.server`` hands it every request under /ui (``respond``) and the
``/ui/live`` websocket (``live``). Pages are rendered on the server with
Jinja2 (autoescaped: every value from a job shows as text); the page's only
scripts are the vendored htmx and its websocket extension, and ``gpuq.js``
(login). Live updates: ``/ui/live`` pushes the page's fragments every
``LIVE_SECONDS`` when they changed, which htmx swaps in by id.

Every response but the login page and the static files needs a session
(``auth``); actions are POSTs with the session's CSRF token in a header and
an Origin of this server.
"""

from __future__ import annotations

import importlib.resources
import json
import time
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

import anyio
import jinja2
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from gpuq import logs, queue
from gpuq.kinds import KIND_RULE, is_kind
from gpuq.ui import auth, views

log = logs.get("ui")

UI = "/ui"
LIVE_PATH = "/ui/live"
LIVE_SECONDS = 1.0
STATIC = {  # name -> content type: the only files served
    "htmx-2.0.11.min.js": "text/javascript",
    "htmx-ext-ws-2.0.4.min.js": "text/javascript",
    "gpuq.js": "text/javascript",
    "gpuq.css": "text/css",
}
# Scripts and styles only from this origin; no inline script, no framing.
SECURITY_HEADERS = [
    ("Content-Security-Policy", "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                                "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
]

_templates = jinja2.Environment(loader=jinja2.PackageLoader("gpuq.ui", "templates"), autoescape=True,
                                undefined=jinja2.StrictUndefined)


class Dashboard:
    """/ui for one ``AgentServer`` (what it reads: ``d``, the dispatcher, and ``slots_status()``)."""

    def __init__(self, server: Any, read_tokens: frozenset[str], admin_tokens: frozenset[str], tls: bool):
        self.server = server
        self.keys = auth.Keys(read_tokens, admin_tokens)
        self.tls = tls
        self._pages: dict[str, Callable[[auth.Session], Awaitable[str]]] = {
            "/ui": self._overview_page, "/ui/agents": self._agents_page}

    # -- HTTP ------------------------------------------------------------

    async def respond(self, connection: ServerConnection, request: Request) -> Response | None:
        """The response to a request under /ui (None: go on with the /ui/live handshake)."""
        url = urlsplit(request.path)
        path = url.path.rstrip("/") or "/"
        if not self.keys.enabled:
            return _text(HTTPStatus.NOT_FOUND, "the dashboard is off: set GPUQ_UI_TOKENS or GPUQ_UI_ADMIN_TOKENS\n")
        if path.startswith("/ui/static/"):
            return _static(path[len("/ui/static/"):])
        if path == "/ui/login":
            return await self._login(request)
        session = self.keys.session(auth.cookie_value(request.headers.get("Cookie")), time.time())
        if session is None:
            if path == LIVE_PATH:
                return _text(HTTPStatus.UNAUTHORIZED, "log in first\n")
            return _reply(HTTPStatus.SEE_OTHER, extra=[("Location", "/ui/login")])
        if path == LIVE_PATH:
            return None if self._same_origin(request) else _text(HTTPStatus.FORBIDDEN, "cross-origin\n")
        if request.method == "POST":
            return await self._action(path, request, session)
        page = self._pages.get(path)
        if page is None:
            return _text(HTTPStatus.NOT_FOUND, f"no page {path}\n")
        return _html(await page(session))

    async def _login(self, request: Request) -> Response:
        """GET: the login form. POST with ``Authorization: Bearer <token>``: a session cookie."""
        if request.method != "POST":
            return _html(_templates.get_template("login.html").render())
        if not self._same_origin(request):
            return _text(HTTPStatus.FORBIDDEN, "cross-origin\n")
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        role = self.keys.role_of(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
        if role is None:
            log.warning("ui.login_refused")
            return _text(HTTPStatus.UNAUTHORIZED, "that token does not open the dashboard\n")
        log.info("ui.login", role=role)
        cookie = auth.set_cookie(self.keys.issue(role, time.time()), self.tls)
        return _reply(HTTPStatus.NO_CONTENT, extra=[("Set-Cookie", cookie)])

    async def _action(self, path: str, request: Request, session: auth.Session) -> Response:
        if not self._same_origin(request) or not self.keys.csrf_ok(session, request.headers.get("X-CSRF-Token")):
            return _text(HTTPStatus.FORBIDDEN, "missing or wrong CSRF token\n")
        if path == "/ui/logout":
            gone = auth.set_cookie("", self.tls).replace(f"Max-Age={auth.SESSION_SECONDS}", "Max-Age=0")
            return _reply(HTTPStatus.NO_CONTENT, extra=[("Set-Cookie", gone), ("HX-Redirect", "/ui/login")])
        if path in ("/ui/kinds/pause", "/ui/kinds/resume"):
            if not session.admin:
                return _text(HTTPStatus.FORBIDDEN, "a read-only session has no actions\n")
            kind = parse_qs(urlsplit(request.path).query).get("kind", [""])[0]
            if not is_kind(kind):
                return _text(HTTPStatus.BAD_REQUEST, f"bad job kind {kind!r}: {KIND_RULE}\n")
            if path.endswith("pause"):  # the CLI's functions: the two cannot disagree
                await queue.pause(self.server.d.pool, kind, by="dashboard")
            else:
                await queue.resume(self.server.d.pool, kind)
            log.info("ui.action", action=path.rsplit("/", 1)[1], kind=kind)
            return _reply(HTTPStatus.NO_CONTENT)
        return _text(HTTPStatus.NOT_FOUND, f"no action {path}\n")

    def _same_origin(self, request: Request) -> bool:
        """A browser names the page's origin on every POST and websocket: it must be this server."""
        origin, host = request.headers.get("Origin"), request.headers.get("Host")
        return origin is not None and host is not None and urlsplit(origin).netloc == host

    # -- pages -----------------------------------------------------------

    def _page(self, template: str, session: auth.Session, page: str, **values: Any) -> str:
        return _templates.get_template(template).render(
            page=page, admin=session.admin, role=session.role,
            headers=json.dumps({"X-CSRF-Token": self.keys.csrf(session)}), **values)

    async def _overview_page(self, session: auth.Session) -> str:
        return self._page("overview.html", session, "overview", overview=await views.overview(self.server))

    async def _agents_page(self, session: auth.Session) -> str:
        return self._page("agents.html", session, "agents", agents=views.agents(self.server))

    # -- live updates ----------------------------------------------------

    async def live(self, ws: ServerConnection) -> None:
        """Push the page's fragments (``?page=overview|agents``) whenever they change."""
        request = ws.request
        page = parse_qs(urlsplit(request.path if request else "").query).get("page", ["overview"])[0]
        session = self.keys.session(auth.cookie_value(request.headers.get("Cookie") if request else None), time.time())
        admin = session is not None and session.admin
        render = {"overview": lambda: self._overview_fragment(admin), "agents": self._agents_fragment}.get(page)
        if render is None:
            await ws.close(1008, "unknown page")
            return
        last = None
        try:
            while True:
                html = await render()
                if html != last:
                    await ws.send(html)
                    last = html
                with anyio.move_on_after(LIVE_SECONDS):  # nothing to send does not notice a close
                    await ws.wait_closed()
                    return
        except ConnectionClosed:
            pass

    async def _overview_fragment(self, admin: bool) -> str:
        return _templates.get_template("overview_body.html").render(
            overview=await views.overview(self.server), oob=True, admin=admin)

    async def _agents_fragment(self) -> str:
        return _templates.get_template("agents_body.html").render(agents=views.agents(self.server), oob=True)


def _reply(status: HTTPStatus, body: bytes = b"", content_type: str | None = None,
           extra: list[tuple[str, str]] | None = None, cache: str = "no-store") -> Response:
    """Every /ui response: its headers, and the security headers."""
    headers = [("Content-Type", content_type)] if content_type else []
    headers += [("Content-Length", str(len(body))), *(extra or [])]
    if body:
        headers.append(("Cache-Control", cache))
    return Response(status.value, status.phrase, Headers([*headers, *SECURITY_HEADERS]), body)


def _html(body: str) -> Response:
    return _reply(HTTPStatus.OK, body.encode(), "text/html; charset=utf-8")


def _text(status: HTTPStatus, text: str) -> Response:
    return _reply(status, text.encode(), "text/plain; charset=utf-8")


def _static(name: str) -> Response:
    kind = STATIC.get(name)
    if kind is None:
        return _text(HTTPStatus.NOT_FOUND, f"no file {name}\n")
    data = importlib.resources.files("gpuq.ui").joinpath("static", name).read_bytes()
    return _reply(HTTPStatus.OK, data, f"{kind}; charset=utf-8", cache="public, max-age=3600")
