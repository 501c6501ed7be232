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
from urllib.parse import urlencode, urlsplit

import anyio
import jinja2
from websockets.asyncio.server import ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from gpuq import logs
from gpuq.admin import LIST_WINDOW, retry_count
from gpuq.census import Census
from gpuq.fleet import Fleet
from gpuq.jobs import JobFilter
from gpuq.loops import run_every
from gpuq.ui import actions, auth, params, views
from gpuq.ui.shared import Shared
from gpuq.ui.trend import Trend

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


def _ms(value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.1f} ms" if value < 1000 else f"{value / 1000:.2f} s"


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


_templates.globals.update(ms=_ms, num=_num, duration=lambda s: views.age(s) or "0 s")
_templates.filters["when"] = views.when


class Dashboard:
    """/ui for one server: what it shows of the agents comes from the fleet read model."""

    def __init__(self, fleet: Fleet, census: Census, read_tokens: frozenset[str], admin_tokens: frozenset[str],
                 tls: bool, sample_seconds: float = 10.0):
        self.fleet = fleet
        self.census = census
        self.keys = auth.Keys(read_tokens, admin_tokens)
        self.tls = tls
        self.trend = Trend(fleet.latency, sample_seconds)
        fleet.latency.enabled = self.keys.enabled  # its figures cost a little: only for a dashboard
        self.shared = Shared(LIVE_SECONDS)
        self._pages: dict[str, Callable[[auth.Session, dict[str, str]], Awaitable[Response]]] = {
            "/ui": self._overview_page, "/ui/agents": self._agents_page, "/ui/jobs": self._jobs_page,
            "/ui/jobs/retry": self._retry_preview, "/ui/controls": self._controls_page}

    # Every page and live socket reads through ``shared``: one read per key a second, however many look.

    async def _overview(self) -> dict[str, Any]:
        return await self.shared.get("overview", lambda: views.overview(self.fleet))

    async def _jobs(self, which: JobFilter, before: int | None) -> dict[str, Any]:
        return await self.shared.get(("jobs", which, before), lambda: views.jobs(self.fleet, which, before))

    async def _controls(self) -> dict[str, Any]:
        return await self.shared.get("controls", lambda: views.controls(self.fleet))

    async def _job(self, job_id: int) -> dict[str, Any] | None:
        return await self.shared.get(("job", job_id), lambda: views.job(self.fleet, job_id))

    async def sample_forever(self) -> None:
        """Take the overview's samples (``trend``) until cancelled: rates from this server's
        counters, queue depth from the census's last read (no sample while its reads fail)."""
        async def sample() -> None:
            if (census := self.census.current) is not None:
                self.trend.take(census.counts)

        await run_every(self.trend.sample_seconds, sample)

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
        args = params.parse(request.path)
        if path.startswith("/ui/jobs/") and path[len("/ui/jobs/"):].isdigit():
            return await self._job_page(session, {**args, "id": path[len("/ui/jobs/"):]})
        page = self._pages.get(path)
        if page is None:
            return _text(HTTPStatus.NOT_FOUND, f"no page {path}\n")
        return await page(session, args)

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
        action = actions.ACTIONS.get(path)
        if action is None:
            return _text(HTTPStatus.NOT_FOUND, f"no action {path}\n")
        if not session.admin:
            return _text(HTTPStatus.FORBIDDEN, "a read-only session has no actions\n")
        try:
            status, text = await action(self.fleet.pool, params.parse(request.path))
        except ValueError as exc:
            return _text(HTTPStatus.BAD_REQUEST, f"{exc}\n")
        finally:
            self.shared.clear()  # every page shows what the action did at its next look
        return _reply(status) if status == HTTPStatus.NO_CONTENT else _text(status, text)

    def _same_origin(self, request: Request) -> bool:
        """A browser names the page's origin on every POST and websocket: it must be this server."""
        origin, host = request.headers.get("Origin"), request.headers.get("Host")
        return origin is not None and host is not None and urlsplit(origin).netloc == host

    # -- pages -----------------------------------------------------------

    def _page(self, template: str, session: auth.Session, page: str, live_params: dict[str, str] | None = None,
              **values: Any) -> str:
        return _templates.get_template(template).render(
            page=page, admin=session.admin, role=session.role, live=urlencode({"page": page, **(live_params or {})}),
            headers=json.dumps({"X-CSRF-Token": self.keys.csrf(session)}), **values)

    async def _overview_page(self, session: auth.Session, args: dict[str, str]) -> Response:
        return _html(self._page("overview.html", session, "overview", overview=await self._overview(),
                                charts=self.trend.charts()))

    async def _agents_page(self, session: auth.Session, args: dict[str, str]) -> Response:
        return _html(self._page("agents.html", session, "agents", agents=views.agents(self.fleet)))

    async def _jobs_page(self, session: auth.Session, args: dict[str, str]) -> Response:
        try:
            which, before = params.job_filter(args), params.before(args)
        except ValueError as exc:
            return _text(HTTPStatus.BAD_REQUEST, f"{exc}\n")
        query = params.filter_query(which)
        return _html(self._page("jobs.html", session, "jobs", live_params={**params.filter_params(which),
                                **({} if before is None else {"before": str(before)})},
                                view=await self._jobs(which, before), query=query, states=views.STATES,
                                window=LIST_WINDOW))

    async def _controls_page(self, session: auth.Session, args: dict[str, str]) -> Response:
        return _html(self._page("controls.html", session, "controls", controls=await self._controls()))

    async def _job_page(self, session: auth.Session, args: dict[str, str]) -> Response:
        try:
            job_id = params.job_id(args["id"])
        except ValueError as exc:
            return _text(HTTPStatus.BAD_REQUEST, f"{exc}\n")
        job = await self._job(job_id)
        if job is None:
            return _text(HTTPStatus.NOT_FOUND, f"no job {job_id}\n")
        return _html(self._page("job.html", session, "job", live_params={"id": str(job_id)}, job=job,
                                outcomes=OUTCOMES))

    async def _retry_preview(self, session: auth.Session, args: dict[str, str]) -> Response:
        """How many jobs a retry by these filters would send back, and the button that does it."""
        if not session.admin:
            return _text(HTTPStatus.FORBIDDEN, "a read-only session has no actions\n")
        try:
            which = params.retry_filter(args)
            n = await retry_count(self.fleet.pool, which)
        except ValueError as exc:
            return _text(HTTPStatus.BAD_REQUEST, f"{exc}\n")
        return _html(_templates.get_template("retry_confirm.html").render(n=n, query=params.filter_query(which)))

    # -- live updates ----------------------------------------------------

    async def live(self, ws: ServerConnection) -> None:
        """Push the page's fragments (``?page=overview|agents``) whenever they change."""
        request = ws.request
        args = params.parse(request.path if request else "")
        session = self.keys.session(auth.cookie_value(request.headers.get("Cookie") if request else None), time.time())
        admin = session is not None and session.admin
        try:
            render = self._fragment(args.get("page", "overview"), args, admin)
        except ValueError as exc:
            await ws.close(1008, str(exc)[:100])
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

    def _fragment(self, page: str, args: dict[str, str], admin: bool) -> Callable[[], Awaitable[str]]:
        """What the live socket of ``page`` sends: a function rendering the page's changing part."""
        def render(template: str, **values: Any) -> str:
            return _templates.get_template(template).render(oob=True, admin=admin, **values)

        async def overview() -> str:
            return render("overview_body.html", overview=await self._overview(), charts=self.trend.charts())

        async def agents() -> str:
            return render("agents_body.html", agents=views.agents(self.fleet))

        async def jobs() -> str:
            return render("jobs_body.html", view=await self._jobs(which, before),
                          query=params.filter_query(which), window=LIST_WINDOW)

        async def job() -> str:
            return render("job_body.html", job=await self._job(job_id), outcomes=OUTCOMES)

        async def controls() -> str:
            return render("controls_body.html", controls=await self._controls())

        if page == "jobs":
            which, before = params.job_filter(args), params.before(args)
        elif page == "job":
            job_id = params.job_id(args.get("id", ""))
        elif page not in ("overview", "agents", "controls"):
            raise ValueError(f"unknown page {page!r}")
        return {"overview": overview, "agents": agents, "jobs": jobs, "job": job, "controls": controls}[page]


# What an attempt's job became, as the job page says it.
OUTCOMES = {"scheduled": "failed, retry scheduled", "pending": "lost (agent left or lease expired), back to pending",
            "leased": "lease expired, leased again", "dead": "failed, dead", "cancelled": "cancelled",
            "running": "running", "done": "done"}


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
