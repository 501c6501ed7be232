"""The network side of ``gpuq serve``: the /agent websocket and /healthz, /status, /metrics.

``serve()`` runs the dispatcher, the sweeper and this server in one anyio
task group. Authentication happens in the HTTP handshake, before any message:
a missing or wrong bearer token gets HTTP 401 and never a job.
"""

from __future__ import annotations

import gc
import hmac
import json
import ssl
import time
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

import anyio
import websockets
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from websockets.asyncio.server import Server, ServerConnection
from websockets.datastructures import Headers
from websockets.exceptions import ConnectionClosed
from websockets.http11 import Request, Response

from gpuq import admin, db, logs, metrics
from gpuq.census import Census
from gpuq.config import ConfigError, ServerConfig
from gpuq.dispatcher import AgentSession, Dispatcher, Tuning
from gpuq.dispatcher.tuning import TUNING_DEFAULT
from gpuq.fleet import Fleet
from gpuq.maintenance import Maintainer
from gpuq.migrate import pending_migrations
from gpuq.protocol import CloseCode, Welcome, server_side
from gpuq.protocol.server_side import ServerProtocol
from gpuq.sql import queries
from gpuq.ui.web import LIVE_PATH, UI, Dashboard

log = logs.get("server")

AGENT_PATH = "/agent"
JOBS_PATH = "/jobs/"


class AgentServer:
    """Websocket + HTTP front of one dispatcher."""

    def __init__(self, dispatcher: Dispatcher, config: ServerConfig, tls: bool = False):
        self.dispatcher = dispatcher
        self.fleet = Fleet(dispatcher)
        self.config = config
        self.census = Census(dispatcher.pool, config.metrics_sample_seconds,
                             fair_share=lambda: dispatcher.fair_share.on)
        self.ui = Dashboard(self.fleet, self.census, config.ui_tokens, config.ui_admin_tokens, tls,
                            config.ui_sample_seconds)
        self._per_ip: dict[str, int] = {}
        self._connections = 0

    # -- HTTP: endpoints and the auth check of the websocket handshake ---

    async def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == UI or path.startswith(UI + "/"):
            return await self.ui.respond(connection, request)
        if path == AGENT_PATH:
            if not self._authorized(request.headers.get("Authorization", "")):
                log.warning("agent.unauthorized", remote=_remote(connection))
                return _response(HTTPStatus.UNAUTHORIZED, b"missing or invalid bearer token\n",
                                 "text/plain", [("WWW-Authenticate", 'Bearer realm="gpuq"')])
            ip = _remote(connection).rsplit(":", 1)[0]
            if self._connections >= self.config.max_connections:
                return _response(HTTPStatus.SERVICE_UNAVAILABLE, b"too many connections\n", "text/plain")
            if self._per_ip.get(ip, 0) >= self.config.max_connections_per_ip:
                return _response(HTTPStatus.TOO_MANY_REQUESTS, b"too many connections from this address\n",
                                 "text/plain")
            return None  # go on with the websocket handshake
        if path.startswith(JOBS_PATH):
            return await self._job(path[len(JOBS_PATH):], request.headers.get("Authorization", ""))
        if path == "/healthz":
            ok, detail = await self.health()
            return _response(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE,
                             json.dumps(detail).encode(), "application/json")
        if path == "/status":  # agents' names, addresses and jobs' progress messages: a token's
            if not self._authorized(request.headers.get("Authorization", ""), self._status_tokens):
                return _response(HTTPStatus.UNAUTHORIZED, b"missing or invalid bearer token\n", "text/plain",
                                 [("WWW-Authenticate", 'Bearer realm="gpuq"')])
            try:
                body = await self.fleet.status()
            except db.RETRYABLE_ERRORS as exc:
                return _response(HTTPStatus.SERVICE_UNAVAILABLE,
                                 json.dumps({"error": f"database unavailable: {exc}"}).encode(), "application/json")
            return _response(HTTPStatus.OK, json.dumps(body).encode(), "application/json")
        if path == "/metrics":
            return _response(HTTPStatus.OK, self._metrics(), CONTENT_TYPE_LATEST)
        return _response(HTTPStatus.NOT_FOUND, b"not found: try /ui, /agent, /healthz, /status, /metrics, /jobs/ID\n",
                         "text/plain")

    def _metrics(self) -> bytes:
        """The Prometheus text. A scrape reads no database, so any number of scrapers cost it
        nothing: queue depth, paused kinds, the backlog and the tenants are the census's last read
        (``gpuq.census``); devices and jobs in flight are set now, from the agents connected."""
        metrics.show_devices(self.fleet.devices())
        metrics.show_inflight(self.fleet.inflight_by_kind())
        return bytes(generate_latest(metrics.REGISTRY))

    async def _job(self, tail: str, authorization: str) -> Response:
        """GET /jobs/ID: the whole job as JSON. Payloads and results are the users' data: the same
        bearer tokens as agents."""
        if not self._authorized(authorization):
            return _response(HTTPStatus.UNAUTHORIZED, b"missing or invalid bearer token\n", "text/plain",
                             [("WWW-Authenticate", 'Bearer realm="gpuq"')])
        if not tail.isdigit() or not 0 < int(tail) < 2**63:
            return _response(HTTPStatus.BAD_REQUEST, b"expected /jobs/<job id>\n", "text/plain")
        try:
            job = await admin.show(self.dispatcher.pool, int(tail))
        except db.RETRYABLE_ERRORS as exc:
            return _response(HTTPStatus.SERVICE_UNAVAILABLE,
                             json.dumps({"error": f"database unavailable: {exc}"}).encode(), "application/json")
        if job is None:
            return _response(HTTPStatus.NOT_FOUND, f"no job {tail}\n".encode(), "text/plain")
        return _response(HTTPStatus.OK, json.dumps(job, default=str).encode(), "application/json")

    @property
    def _status_tokens(self) -> frozenset[str]:
        """Who may read /status: agents' tokens and the dashboard's, read-only or admin."""
        return self.config.tokens | self.config.ui_tokens | self.config.ui_admin_tokens

    def _authorized(self, header: str, tokens: frozenset[str] | None = None) -> bool:
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            return False
        # Compare against every token, in constant time, without stopping early.
        found = False
        for t in self.config.tokens if tokens is None else tokens:
            found |= hmac.compare_digest(token.strip().encode(), t.encode())
        return found

    async def health(self) -> tuple[bool, dict[str, Any]]:
        db_ok = True
        try:
            with anyio.fail_after(2):
                await self.dispatcher.pool.fetchval(queries["ping"])
        except db.RETRYABLE_ERRORS + (TimeoutError,):
            db_ok = False
        polling = self.config.listen_url is None  # poll-only: nothing to listen on
        d = self.dispatcher
        ok = db_ok and (d.listening or polling) and not d.stopping
        return ok, {"ok": ok, "database": db_ok, "listening": d.listening, "poll_only": polling,
                    "draining": d.stopping}

    # -- websocket: one agent connection ---------------------------------
    # This layer only pumps frames: every rule of the connection is in
    # protocol/server_side.py.

    async def handle(self, ws: ServerConnection) -> None:
        if ws.request is not None and ws.request.path.startswith(LIVE_PATH):
            await self.ui.live(ws)  # process_request let only a logged-in page of this origin here
            return
        ip = _remote(ws).rsplit(":", 1)[0]
        self._connections += 1
        self._per_ip[ip] = self._per_ip.get(ip, 0) + 1
        try:
            await self._handle(ws)
        finally:
            self._connections -= 1
            self._per_ip[ip] -= 1
            if not self._per_ip[ip]:
                del self._per_ip[ip]

    async def _handle(self, ws: ServerConnection) -> None:
        proto = ServerProtocol(max_payload=self.config.max_payload, now=time.monotonic(),
                               max_messages_per_second=self.config.max_messages_per_second,
                               hello_timeout=self.dispatcher.tuning.hello_timeout_seconds,
                               max_errors=self.dispatcher.tuning.max_errors_per_connection)
        if not await self._hello(ws, proto):
            return
        wake = [anyio.Event()]  # the writer replaces it each time it wakes

        def flush() -> None:
            wake[0].set()

        session = AgentSession(proto, flush=flush, remote=_remote(ws))
        proto.accept(Welcome(session.id, self.config.lease_seconds, self.config.heartbeat_seconds,
                             self.config.max_payload, proto.version))
        await _send_all(ws, proto)
        await self.dispatcher.admit(session)
        self.dispatcher.register(session)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_writer, ws, proto, wake)
                await self._reader(ws, session)
                tg.cancel_scope.cancel()
        finally:
            await self.dispatcher.unregister(session)

    async def _hello(self, ws: ServerConnection, proto: ServerProtocol) -> bool:
        """Wait for the hello until its deadline; True once the connection is open."""
        try:
            with anyio.move_on_after(max(0.0, proto.hello_deadline - time.monotonic())) as waited:
                self._refused(proto.receive(await ws.recv(), time.monotonic()))
        except ConnectionClosed:
            return False
        if waited.cancelled_caught:
            proto.check_deadline(proto.hello_deadline)
        return not await _close_if_asked(ws, proto) and proto.state is server_side.State.OPEN

    async def _reader(self, ws: ServerConnection, session: AgentSession) -> None:
        proto = session.protocol
        try:
            async for frame in ws:
                for event in proto.receive(frame, time.monotonic()):
                    self._on_event(session, event)
                session.flush()
                if await _close_if_asked(ws, proto):
                    return
        except ConnectionClosed:
            pass

    def _on_event(self, session: AgentSession, event: server_side.Event) -> None:
        """Hand one event to the dispatcher; none waits on the database."""
        d = self.dispatcher
        if isinstance(event, server_side.OutcomesReceived):
            # Fenced in the database by the lease token; acked either way.
            if event.failed_on:
                d.failed_on(session, event.failed_on)
            d.submit(session, event.outcomes, event.freed, event.ran)
        elif isinstance(event, server_side.HeartbeatReceived):
            d.heartbeat(session, event.ids)
        elif isinstance(event, server_side.DrainRequested):
            d.agent_draining(session)
        elif isinstance(event, server_side.ProgressReceived):
            d.report_progress(event.updates)
        elif isinstance(event, server_side.CheckpointsReceived):
            d.checkpoint(session, event.items)
        elif isinstance(event, server_side.AgentUpdated):
            d.agent_updated(session)
        elif isinstance(event, server_side.JobsReleased):
            d.released(session, event.jobs)
        elif isinstance(event, server_side.DeviceFaulted):
            d.device_fault(session, event.fault)
        elif isinstance(event, server_side.SlotsReported):
            metrics.SLOT_GAPS.add(event.report)
        else:
            self._refused([event])

    def _refused(self, events: list[server_side.Event]) -> None:
        for event in events:
            if isinstance(event, server_side.FrameRefused):
                metrics.PROTOCOL_ERRORS.labels(code=event.code).inc()


async def _writer(ws: ServerConnection, proto: ServerProtocol, wake: list[anyio.Event]) -> None:
    """Send what the protocol queued whenever the dispatcher or the reader flushes."""
    try:
        while True:
            await wake[0].wait()
            wake[0] = anyio.Event()
            await _send_all(ws, proto)
    except ConnectionClosed:
        pass


async def _send_all(ws: ServerConnection, proto: ServerProtocol) -> None:
    for frame in proto.frames_to_send():
        await ws.send(frame)


async def _close_if_asked(ws: ServerConnection, proto: ServerProtocol) -> bool:
    """Send the protocol's last frames and its close, if it asks for one."""
    close = proto.close_to_send()
    if close is None:
        return False
    code, reason = close
    if code is CloseCode.RATE_LIMITED:
        log.warning("agent.rate_limited", remote=_remote(ws))
    try:
        await _send_all(ws, proto)
    except ConnectionClosed:
        pass
    await ws.close(code, reason)
    return True


def _response(status: HTTPStatus, body: bytes, content_type: str,
              extra: list[tuple[str, str]] | None = None) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))),
                       ("Cache-Control", "no-store"), *(extra or [])])
    return Response(status.value, status.phrase, headers, body)


def _remote(connection: ServerConnection) -> str:
    addr = connection.remote_address
    return f"{addr[0]}:{addr[1]}" if addr else "?"


def ssl_context(cert: str | None, key: str | None) -> ssl.SSLContext | None:
    if not cert and not key:
        return None
    if not (cert and key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key")
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS certificate/key: {exc}") from None
    return ctx


async def serve(
    config: ServerConfig,
    *,
    stop: anyio.Event | None = None,
    on_ready: Callable[[int], None] | None = None,
    tls: ssl.SSLContext | None = None,
    tuning: Tuning = TUNING_DEFAULT,
    freeze_startup: bool = False,
) -> None:
    """Run dispatcher + sweeper + server until ``stop`` is set, then drain and return.

    ``freeze_startup`` (``gpuq serve``, a process of its own): once started,
    every object so far goes to the collector's permanent generation
    (``gc.freeze``), so a full collection scans only what serving made; without
    it one came early in each run and held every push up for 25-35 ms
    (docs/benchmarks.md, "The layout of parts").
    """
    if not config.tokens:
        raise ConfigError("no agent tokens: set GPUQ_TOKENS (comma-separated) or --tokens")
    stop = stop or anyio.Event()
    pool = await db.create_pool(config.database_url, min_size=2, max_size=10,
                                pooler=config.pooler == "transaction")
    try:
        async with pool.acquire() as conn:
            if missing := await pending_migrations(conn):
                raise ConfigError(f"the database is not migrated (missing {', '.join(missing)}): run `gpuq migrate`")
        dispatcher = Dispatcher(pool, config, tuning)
        front = AgentServer(dispatcher, config, tls=tls is not None)
        maintainer = Maintainer.standard(pool, config.sweep_seconds, config.retention_seconds)
        async with anyio.create_task_group() as tg:
            tg.start_soon(dispatcher.run)
            tg.start_soon(maintainer.run)
            await tg.start(front.census.run)  # its first read before the first scrape can come
            if front.ui.keys.enabled:
                tg.start_soon(front.ui.sample_forever)
            async with websockets.serve(
                front.handle, config.listen[0], config.listen[1], process_request=front.process_request,
                max_size=config.max_payload, ssl=tls, compression=None, logger=_quiet_logger(),
            ) as server:
                port = _port(server)
                if freeze_startup:
                    gc.collect()
                    gc.freeze()
                log.info("listen.mode", **_listen_mode(config))
                log.info("server.listening", host=config.listen[0], port=port, tls=tls is not None,
                         lease_seconds=config.lease_seconds, tokens=len(config.tokens),
                         event_loop=logs.event_loop_name(), gc_frozen=gc.get_freeze_count())
                if on_ready:
                    on_ready(port)
                await stop.wait()
                await dispatcher.drain(config.drain_seconds)
                server.close(close_connections=True)
                await server.wait_closed()
                await dispatcher.leave()
            tg.cancel_scope.cancel()
    finally:
        await db.close_pool(pool, tuning.shutdown_db_seconds)  # a hung database must not hold SIGTERM
    log.info("server.stopped")


def _listen_mode(config: ServerConfig) -> dict[str, Any]:
    """What the startup log says about wake-ups: LISTEN on which URL, or poll only."""
    if config.listen_url is None:
        return {"mode": "poll", "poll_seconds": config.poll_seconds, "pooler": config.pooler,
                "reason": "DATABASE_URL is pooled and no GPUQ_DIRECT_URL is set: LISTEN needs a session"}
    return {"mode": "listen", "url": db.redact(config.listen_url), "pooler": config.pooler,
            "via": "GPUQ_DIRECT_URL" if config.direct_url else "DATABASE_URL"}


def _port(server: Server) -> int:
    return int(next(iter(server.sockets)).getsockname()[1])


def _quiet_logger() -> Any:
    # websockets logs handshake failures (our 401s, port scans) at INFO through
    # stdlib logging; we log what matters ourselves with structlog.
    import logging

    lg = logging.getLogger("gpuq.websockets")
    lg.setLevel(logging.WARNING)
    return lg
