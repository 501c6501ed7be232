"""Every setting of gpuq, one row each: name, environment variable, default, parser, help, flags.

``SETTINGS`` is the single source: CLI flags and their help are built from it
(``add_flags``), ``ServerConfig`` takes its defaults from it, the README's
configuration table is generated from it (``markdown_table``), and the deploy
files are checked against it by tests. Flags override the environment; the
environment overrides the defaults. A bad value raises ``ConfigError``, one
line naming the setting.
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A setting has a bad value (one clear line for the CLI)."""


# -- parsers: (text, label) -> value ----------------------------------------


def parse_duration(text: str, name: str = "duration") -> float:
    """Seconds from ``90``, ``1.5``, ``45s``, ``30m``, ``12h`` or ``7d``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not m:
        raise ConfigError(f"{name}: {text!r} is not a duration (e.g. 30, 45s, 30m, 12h, 7d)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def parse_listen(text: str, name: str = "GPUQ_LISTEN") -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{name}: {text!r} is not host:port (e.g. 127.0.0.1:8765)")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 (":8765" means all interfaces)


def parse_tokens(text: str, name: str = "GPUQ_TOKENS") -> frozenset[str]:
    tokens = frozenset(t.strip() for t in text.split(",") if t.strip())
    if not tokens:
        raise ConfigError(f"{name} is set but holds no token")
    return tokens


def parse_int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}: {text!r} is not an integer") from None


def parse_text(text: str, name: str) -> str:
    return text


def _choice(*options: str) -> Callable[[str, str], str]:
    def parse(text: str, name: str) -> str:
        value = text.strip().lower() or options[0]
        if value not in options:
            raise ConfigError(f"{name}: {value!r} is not one of {', '.join(options)}")
        return value

    return parse


def parse_kinds(text: str, name: str = "GPUQ_KINDS") -> list[str]:
    return [k.strip() for k in text.split(",") if k.strip()]


def parse_list(text: str, name: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())


# -- the table ---------------------------------------------------------------

SERVE = "serve"
AGENT = "agent"
LOGGED = ("serve", "sweep", "agent", "dev")  # the long-running commands


@dataclass(frozen=True)
class Setting:
    name: str  # the field name (ServerConfig, parsed flags)
    env: str
    default: Any  # None: unset (see ``shown``)
    parse: Callable[[str, str], Any]
    help: str
    flags: Mapping[str, str] = field(default_factory=dict)  # command -> its flag
    shown: str | None = None  # the default as the docs show it, when not str(default)
    used_by: str = ""  # who reads it, for the docs (default: the flags' commands)

    @property
    def shown_default(self) -> str:
        if self.shown is not None:
            return self.shown
        if isinstance(self.default, float) and self.default.is_integer():
            return str(int(self.default))
        return str(self.default)

    @property
    def users(self) -> str:
        return self.used_by or ", ".join(self.flags)


_DB_COMMANDS = ("migrate", "serve", "sweep", "enqueue", "status", "jobs", "pause", "resume", "retry", "cancel", "preempt", "show",
                "wait", "schedule", "kind-timeout", "limit", "batch", "tenant", "device")

SETTINGS: tuple[Setting, ...] = (
    Setting("database_url", "DATABASE_URL", None, parse_text, "PostgreSQL DSN",
            {c: "--database-url" for c in _DB_COMMANDS}, shown="required (not for `dev`)"),
    Setting("pooler", "GPUQ_POOLER", "none", _choice("none", "transaction"),
            "`transaction`: DATABASE_URL goes through a transaction pooler (PgBouncer): no startup "
            "parameters or statement cache, planner guards set per transaction",
            {c: "--pooler" for c in _DB_COMMANDS}),
    Setting("direct_url", "GPUQ_DIRECT_URL", None, parse_text,
            "a direct (session) PostgreSQL URL for LISTEN and migrations when DATABASE_URL is pooled; "
            "pooled without it, serve polls", {SERVE: "--direct-url", "migrate": "--direct-url"},
            shown="DATABASE_URL (pooled: none)"),
    Setting("connect_timeout", "GPUQ_CONNECT_TIMEOUT", 5.0, parse_duration,
            "each host of a (multi-host) DSN gets this long to connect and be what target_session_attrs "
            "asks before the next is tried (0: no limit)", used_by="every command that connects"),
    Setting("command_timeout", "GPUQ_COMMAND_TIMEOUT", 5.0, parse_duration,
            "the longest any statement may take; the connection is then dropped, never reused: a hung "
            "database is found this fast (0: no limit; migrations have none; a bulk enqueue gets 1 s "
            "per 2,000 rows when longer)",
            used_by="every command that connects"),
    Setting("listen", "GPUQ_LISTEN", ("127.0.0.1", 8765), parse_listen,
            "host:port of /agent and the HTTP endpoints", {SERVE: "--listen"}, shown="`127.0.0.1:8765`"),
    Setting("tokens", "GPUQ_TOKENS", frozenset(), parse_tokens,
            "comma-separated bearer tokens agents may present", {SERVE: "--tokens"}, shown="required"),
    Setting("ui_tokens", "GPUQ_UI_TOKENS", frozenset(), parse_tokens,
            "comma-separated tokens that open the dashboard (/ui) read-only; agents' tokens do not",
            {SERVE: "--ui-tokens"}, shown="none (no read-only login)"),
    Setting("ui_admin_tokens", "GPUQ_UI_ADMIN_TOKENS", frozenset(), parse_tokens,
            "comma-separated tokens that open the dashboard as admin, with its actions",
            {SERVE: "--ui-admin-tokens"}, shown="none (no admin login)"),
    Setting("ui_sample_seconds", "GPUQ_UI_SAMPLE_SECONDS", 10.0, parse_duration,
            "how often the dashboard samples rates, queue depth and latency for its last-hour charts",
            {SERVE: "--ui-sample-seconds"}),
    Setting("metrics_sample_seconds", "GPUQ_METRICS_SAMPLE_SECONDS", 5.0, parse_duration,
            "how often serve reads queue depth, paused kinds, the backlog per kind and shape and (fair share "
            "on) the tenants' usage for /metrics (a scrape reads no database; after a read of d seconds the "
            "next waits at least 50 d)",
            {SERVE: "--metrics-sample-seconds"}),
    Setting("lease_seconds", "GPUQ_LEASE_SECONDS", 60.0, parse_duration,
            "lease length; a silent agent's jobs return after it", {SERVE: "--lease-seconds"}),
    Setting("heartbeat_seconds", "GPUQ_HEARTBEAT_SECONDS", 15.0, parse_duration,
            "agents' heartbeat interval (below the lease)", {SERVE: "--heartbeat-seconds"}),
    Setting("poll_seconds", "GPUQ_POLL_SECONDS", 2.0, parse_duration,
            "lease poll while agents have free credit (a lost NOTIFY costs at most this)",
            {SERVE: "--poll-seconds"}),
    Setting("busy_poll_seconds", "GPUQ_BUSY_POLL_SECONDS", 0.005, parse_duration,
            "while polls keep finding work the dispatcher polls this often and producers do not "
            "NOTIFY (their commits are not serialized); it asks for wake-ups once a poll finds none",
            {SERVE: "--busy-poll-seconds"}),
    Setting("reserve_after_seconds", "GPUQ_RESERVE_AFTER", 60.0, parse_duration,
            "a multi-GPU job waiting this long gets an agent reserved: no other GPU job starts there "
            "until enough of its devices are free", {SERVE: "--reserve-after"}),
    Setting("warm_wait_seconds", "GPUQ_WARM_WAIT", 5.0, parse_duration,
            "a job naming a model waits up to this long for an agent holding it warm before it goes to "
            "one that must load it (0: never waits); set it near your models' load time",
            {SERVE: "--warm-wait"}),
    Setting("preempt_min_run_seconds", "GPUQ_PREEMPT_MIN_RUN", 60.0, parse_duration,
            "a job that finds no free devices (or slot) may preempt lower-priority preemptible jobs that ran at "
            "least this long", {SERVE: "--preempt-min-run"}),
    Setting("quarantine_faults", "GPUQ_QUARANTINE_FAULTS", 3, parse_int,
            "a GPU whose jobs raise DeviceError this many times within GPUQ_QUARANTINE_WINDOW is "
            "quarantined: no new job goes there until `gpuq device clear` (an Xid or uncorrectable ECC "
            "error an agent reads through NVML quarantines it at once)", {SERVE: "--quarantine-faults"}),
    Setting("quarantine_window_seconds", "GPUQ_QUARANTINE_WINDOW", 600.0, parse_duration,
            "the window in which a GPU's DeviceError faults count toward GPUQ_QUARANTINE_FAULTS",
            {SERVE: "--quarantine-window"}),
    Setting("sweep_seconds", "GPUQ_SWEEP_SECONDS", 2.0, parse_duration,
            "interval of the maintenance services (reclaim, promote, retention)",
            {"sweep": "--interval"}, used_by="serve, sweep"),
    Setting("retention_seconds", "GPUQ_RETENTION", None, parse_duration,
            "delete done/dead jobs older than this (`7d`, `12h`, `30m`, seconds)",
            {SERVE: "--retention", "sweep": "--retention"}, shown="keep"),
    Setting("drain_seconds", "GPUQ_DRAIN_SECONDS", 30.0, parse_duration,
            "on SIGTERM, wait this long for agents' results", {SERVE: "--drain-seconds"}),
    Setting("max_payload", "GPUQ_MAX_PAYLOAD", 1 << 20, parse_int,
            "largest frame from an agent, bytes (close 1009)", used_by=SERVE),
    Setting("max_batch", "GPUQ_MAX_BATCH", 256, parse_int,
            "jobs per lease statement (shared by the agents that take the same kinds)", used_by=SERVE),
    Setting("max_connections", "GPUQ_MAX_CONNECTIONS", 10_000, parse_int,
            "agent connections in total (more get HTTP 503)", used_by=SERVE),
    Setting("max_connections_per_ip", "GPUQ_MAX_CONNECTIONS_PER_IP", 2_000, parse_int,
            "per peer address (more get HTTP 429)", used_by=SERVE),
    Setting("max_messages_per_second", "GPUQ_MAX_MESSAGES_PER_SECOND", 5_000, parse_int,
            "per connection, 2 s burst (close 4008)", used_by=SERVE),
    Setting("tls_cert", "GPUQ_TLS_CERT", None, parse_text, "PEM certificate: serve wss:// and https://",
            {SERVE: "--tls-cert"}, shown="off"),
    Setting("tls_key", "GPUQ_TLS_KEY", None, parse_text, "PEM private key for the certificate",
            {SERVE: "--tls-key"}, shown="off"),
    Setting("url", "GPUQ_URL", "ws://127.0.0.1:8765/agent", parse_text, "server websocket URL",
            {AGENT: "--url"}),
    Setting("token", "GPUQ_TOKEN", None, parse_text,
            "bearer token (an agent's; `status --server` may also use a dashboard token)",
            {AGENT: "--token", "status": "--token"}, shown="required (agent)"),
    Setting("kinds", "GPUQ_KINDS", None, parse_kinds, "comma-separated job kinds to take",
            {AGENT: "--kinds"}, shown="required"),
    Setting("agent_drain_seconds", "GPUQ_AGENT_DRAIN_SECONDS", None, parse_duration,
            "on SIGTERM, an agent stops taking jobs and exits once its running jobs are reported, or "
            "after this long whatever is left (logged; the server gives running jobs back)",
            {AGENT: "--drain-seconds"}, shown="none: waits for every report"),
    Setting("interruption_notice", "GPUQ_INTERRUPTION_NOTICE", None, parse_duration,
            "on SIGTERM, a spot interruption with this much notice: jobs held ready go back at once, running "
            "preemptible jobs yield within the notice less a margin (their attempt not counted), and the agent "
            "exits by the notice", {AGENT: "--interruption-notice"}, shown="none: a stop (--drain-seconds)"),
    Setting("capacity", "GPUQ_CAPACITY", 1, parse_int, "jobs run at once", {AGENT: "--capacity"}),
    Setting("prefetch", "GPUQ_PREFETCH", 1, parse_int,
            "jobs held ready beyond capacity (and one per busy GPU), so a freed slot starts the next at once (0: none)",
            {AGENT: "--prefetch"}),
    Setting("handler", "GPUQ_HANDLER", "gpuq.demo:handle", parse_text, "module:function called per job",
            {AGENT: "--handler"}),
    Setting("batch_handler", "GPUQ_BATCH_HANDLER", None, parse_text,
            "module:function called with a list of jobs, one entry per job returned (protocol 7); with "
            "no --handler it also takes single jobs, as batches of one", {AGENT: "--batch-handler"},
            shown="none"),
    Setting("agent_max_batch", "GPUQ_AGENT_MAX_BATCH", 64, parse_int,
            "most jobs one batch handler call takes (1-4096; with --batch-handler)", {AGENT: "--max-batch"}),
    Setting("checkpoint_seconds", "GPUQ_CHECKPOINT_SECONDS", 1.0, parse_duration,
            "a job's `job.checkpoint()` goes to the server at most this often (its first at once; the latest "
            "of those in between when it lapses, and one still waiting before the job's outcome; 0: each at once)",
            {AGENT: "--checkpoint-seconds"}),
    Setting("agent_name", "GPUQ_AGENT_NAME", None, parse_text, "agent name in logs and leased_by",
            {AGENT: "--name"}, shown="hostname"),
    Setting("devices", "GPUQ_DEVICES", "auto", parse_text,
            "the GPUs this agent gives to jobs: `auto` (NVML, within CUDA_VISIBLE_DEVICES), `none`, or "
            "`NAME:MEMORY,...` (`h100:80G,h100:80G`; indices 0, 1, ...)", {AGENT: "--devices"}),
    Setting("labels", "GPUQ_LABELS", (), parse_list,
            "comma-separated labels jobs may require (`gpu=h100,region=eu`)", {AGENT: "--labels"},
            shown="none"),
    Setting("models", "GPUQ_MODELS", (), parse_list,
            "comma-separated models held warm at start (the handler may change them)", {AGENT: "--models"},
            shown="none"),
    Setting("log_format", "GPUQ_LOG_FORMAT", "auto", _choice("auto", "json", "console"),
            "`json` lines, or `console`; auto = console on a terminal", dict.fromkeys(LOGGED, "--log-format")),
    Setting("log_level", "GPUQ_LOG_LEVEL", "info", _choice("info", "debug", "warning", "error", "critical"),
            "debug, info, warning, error", dict.fromkeys(LOGGED, "--log-level")),
    Setting("event_loop", "GPUQ_EVENT_LOOP", "auto", _choice("auto", "uvloop", "asyncio"),
            "`uvloop` (auto picks it where installed; a dependency on Linux) or `asyncio`; "
            "logged as `event_loop` at startup", used_by="serve, agent, sweep, dev"),
    Setting("pg_bindir", "GPUQ_PG_BINDIR", None, parse_text,
            "PostgreSQL server binaries for `dev` and the tests", shown="found", used_by="dev, tests"),
    Setting("migrations", "GPUQ_MIGRATIONS", None, parse_text, "a different migrations directory",
            shown="shipped SQL", used_by="migrate, serve"),
    Setting("demo_seconds", "GPUQ_DEMO_SECONDS", 0.05, parse_duration,
            "simulated GPU time of the demo handler", used_by="gpuq.demo:handle"),
)
BY_NAME = {s.name: s for s in SETTINGS}
BY_ENV = {s.env: s for s in SETTINGS}


def default(name: str) -> Any:
    return BY_NAME[name].default


def get(name: str, env: Mapping[str, str] | None = None, flag: str | None = None) -> Any:
    """The value of a setting: the flag's text, else the environment's, else the default."""
    s = BY_NAME[name]
    text = flag if flag is not None else (os.environ if env is None else env).get(s.env) or None
    return s.default if text is None else s.parse(text, s.env)


def given(name: str, flag: str | None = None, env: Mapping[str, str] | None = None) -> bool:
    """Whether a setting was set (by its flag or its variable), not left to its default."""
    return flag is not None or bool((os.environ if env is None else env).get(BY_NAME[name].env))


# -- the CLI -----------------------------------------------------------------


def add_flags(parser: argparse.ArgumentParser, command: str) -> None:
    """Add every setting's flag for ``command``; values stay text until ``get`` parses them."""
    for s in SETTINGS:
        if flag := s.flags.get(command):
            parser.add_argument(flag, dest=s.name, default=None, metavar=flag[2:].upper().replace("-", "_"),
                                help=f"{s.help} (env {s.env}; default: {s.shown_default})".replace("`", ""))


def flag_values(args: argparse.Namespace, command: str) -> dict[str, str]:
    """The flags given on the command line, by setting name, as text."""
    return {s.name: v for s in SETTINGS if command in s.flags
            and (v := getattr(args, s.name, None)) is not None}


# -- gpuq serve --------------------------------------------------------------


@dataclass(frozen=True)
class ServerConfig:
    """Settings of ``gpuq serve`` (dispatcher + maintenance + websocket/HTTP server)."""

    database_url: str
    pooler: str = default("pooler")
    direct_url: str | None = default("direct_url")
    listen: tuple[str, int] = default("listen")
    tokens: frozenset[str] = default("tokens")
    ui_tokens: frozenset[str] = default("ui_tokens")
    ui_admin_tokens: frozenset[str] = default("ui_admin_tokens")
    ui_sample_seconds: float = default("ui_sample_seconds")
    metrics_sample_seconds: float = default("metrics_sample_seconds")
    lease_seconds: float = default("lease_seconds")
    heartbeat_seconds: float = default("heartbeat_seconds")
    poll_seconds: float = default("poll_seconds")
    busy_poll_seconds: float = default("busy_poll_seconds")
    max_payload: int = default("max_payload")
    max_batch: int = default("max_batch")
    sweep_seconds: float = default("sweep_seconds")
    retention_seconds: float | None = default("retention_seconds")
    drain_seconds: float = default("drain_seconds")
    max_connections: int = default("max_connections")
    max_connections_per_ip: int = default("max_connections_per_ip")
    max_messages_per_second: int = default("max_messages_per_second")
    reserve_after_seconds: float = default("reserve_after_seconds")
    warm_wait_seconds: float = default("warm_wait_seconds")
    preempt_min_run_seconds: float = default("preempt_min_run_seconds")
    quarantine_faults: int = default("quarantine_faults")
    quarantine_window_seconds: float = default("quarantine_window_seconds")

    def __post_init__(self) -> None:
        for name in ("lease_seconds", "heartbeat_seconds", "poll_seconds", "busy_poll_seconds", "sweep_seconds", "drain_seconds",
                     "reserve_after_seconds", "ui_sample_seconds", "metrics_sample_seconds",
                     "quarantine_window_seconds"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, not {getattr(self, name)}")
        if self.heartbeat_seconds >= self.lease_seconds:
            raise ConfigError(
                f"heartbeat_seconds ({self.heartbeat_seconds}) must be shorter than lease_seconds "
                f"({self.lease_seconds}), or leases expire between heartbeats"
            )
        if (self.ui_tokens | self.ui_admin_tokens) & self.tokens:
            raise ConfigError("a dashboard token is also an agent token: give the dashboard its own")
        if self.ui_tokens & self.ui_admin_tokens:
            raise ConfigError("a token is both read-only and admin for the dashboard: give each one role")
        for name in ("warm_wait_seconds", "preempt_min_run_seconds"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be 0 or more, not {getattr(self, name)}")
        if self.max_payload < 1024:
            raise ConfigError(f"max_payload must be at least 1024 bytes, not {self.max_payload}")
        for name in ("max_batch", "max_connections", "max_connections_per_ip", "max_messages_per_second",
                     "quarantine_faults"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, not {getattr(self, name)}")

    @property
    def listen_url(self) -> str | None:
        """Where the dispatcher LISTENs: the direct URL, else DATABASE_URL unless it is pooled
        (LISTEN does not work through a transaction pooler): None means poll only."""
        return self.direct_url or (None if self.pooler == "transaction" else self.database_url)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, flags: Mapping[str, str] | None = None,
                 **overrides: Any) -> ServerConfig:
        """From the environment, then ``flags`` (text, by setting name), then ``overrides`` (values)."""
        flags = flags or {}
        names = [f for f in cls.__dataclass_fields__]
        values = {n: get(n, env, flags.get(n)) for n in names}
        values.update({k: v for k, v in overrides.items() if v is not None})
        if not values.get("database_url"):
            raise ConfigError("no database: set DATABASE_URL or --database-url (or run `gpuq dev`)")
        return cls(**values)


# -- docs --------------------------------------------------------------------


def markdown_table() -> str:
    """The README's configuration table (tests/unit/test_config.py keeps the README equal to it)."""
    rows = ["| flag | environment | default | used by | meaning |", "|---|---|---|---|---|"]
    for s in SETTINGS:
        shown = f"`{s.shown_default}`" if s.shown is None else s.shown
        rows.append(f"| {_flags_cell(s)} | `{s.env}` | {shown} | {s.users} | {s.help} |")
    return "\n".join(rows)


def _flags_cell(s: Setting) -> str:
    by_flag: dict[str, list[str]] = {}
    for command, flag in s.flags.items():
        by_flag.setdefault(flag, []).append(command)
    cells = [f"`{flag}`" if len(commands) > 2 else ", ".join(f"`{c} {flag}`" for c in commands)
             for flag, commands in by_flag.items()]
    return ", ".join(cells) or "—"


if __name__ == "__main__":  # python -m gpuq.config: print the README table
    print(markdown_table())
