"""Configuration: every setting, its environment variable, its default, in one table.

Flags override the environment; the environment overrides the defaults. Bad
values raise ``ConfigError`` with one line naming the setting.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A setting has a bad value (one clear line for the CLI)."""


def parse_duration(text: str, name: str = "duration") -> float:
    """Seconds from ``90``, ``1.5``, ``45s``, ``30m``, ``12h`` or ``7d``."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", str(text))
    if not m:
        raise ConfigError(f"{name}: {text!r} is not a duration (e.g. 30, 45s, 30m, 12h, 7d)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"GPUQ_LISTEN: {text!r} is not host:port (e.g. 127.0.0.1:8765)")
    return host.strip("[]") or "0.0.0.0", int(port)  # noqa: S104 (":8765" means all interfaces)


def _positive(value: float, name: str) -> float:
    if value <= 0:
        raise ConfigError(f"{name} must be positive, not {value}")
    return value


@dataclass(frozen=True)
class ServerConfig:
    """Settings of ``gpuq serve`` (dispatcher + sweeper + websocket/HTTP server)."""

    database_url: str
    listen: tuple[str, int] = ("127.0.0.1", 8765)
    tokens: frozenset[str] = field(default_factory=frozenset)
    lease_seconds: float = 60.0
    heartbeat_seconds: float = 15.0
    poll_seconds: float = 2.0
    max_payload: int = 1 << 20
    # Jobs per lease statement, shared by the agents that take the same kinds:
    # 256 beat 64 by 10-39% in the throughput bench (4 agents x 64, fewer commits).
    max_batch: int = 256
    sweep_seconds: float = 2.0
    retention_seconds: float | None = None
    drain_seconds: float = 30.0
    max_connections: int = 10_000  # agent connections, in total
    max_connections_per_ip: int = 2_000
    max_messages_per_second: int = 5_000  # per connection, averaged over a 2 s burst

    def __post_init__(self) -> None:
        for name in ("lease_seconds", "heartbeat_seconds", "poll_seconds", "sweep_seconds", "drain_seconds"):
            _positive(getattr(self, name), name)
        if self.heartbeat_seconds >= self.lease_seconds:
            raise ConfigError(
                f"heartbeat_seconds ({self.heartbeat_seconds}) must be shorter than lease_seconds "
                f"({self.lease_seconds}), or leases expire between heartbeats"
            )
        if self.max_payload < 1024:
            raise ConfigError(f"max_payload must be at least 1024 bytes, not {self.max_payload}")
        for name in ("max_batch", "max_connections", "max_connections_per_ip", "max_messages_per_second"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, not {getattr(self, name)}")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None, **overrides: Any) -> ServerConfig:
        """Build from ``GPUQ_*``/``DATABASE_URL`` variables, then ``overrides`` (non-None flags)."""
        env = dict(os.environ if env is None else env)
        values: dict[str, Any] = {}
        if v := env.get("DATABASE_URL"):
            values["database_url"] = v
        if v := env.get("GPUQ_LISTEN"):
            values["listen"] = parse_listen(v)
        if v := env.get("GPUQ_TOKENS"):
            values["tokens"] = parse_tokens(v)
        for key, name in DURATIONS.items():
            if v := env.get(name):
                values[key] = parse_duration(v, name)
        for key, name in INTEGERS.items():
            if v := env.get(name):
                values[key] = _int(v, name)
        values.update({k: v for k, v in overrides.items() if v is not None})
        if not values.get("database_url"):
            raise ConfigError("no database: set DATABASE_URL or --database-url (or run `gpuq dev`)")
        return cls(**values)


DURATIONS = {
    "lease_seconds": "GPUQ_LEASE_SECONDS",
    "heartbeat_seconds": "GPUQ_HEARTBEAT_SECONDS",
    "poll_seconds": "GPUQ_POLL_SECONDS",
    "sweep_seconds": "GPUQ_SWEEP_SECONDS",
    "retention_seconds": "GPUQ_RETENTION",
    "drain_seconds": "GPUQ_DRAIN_SECONDS",
}
INTEGERS = {
    "max_payload": "GPUQ_MAX_PAYLOAD",
    "max_batch": "GPUQ_MAX_BATCH",
    "max_connections": "GPUQ_MAX_CONNECTIONS",
    "max_connections_per_ip": "GPUQ_MAX_CONNECTIONS_PER_IP",
    "max_messages_per_second": "GPUQ_MAX_MESSAGES_PER_SECOND",
}


EVENT_LOOPS = ("auto", "uvloop", "asyncio")


def use_uvloop(env: dict[str, str] | None = None) -> bool:
    """``GPUQ_EVENT_LOOP``: uvloop (the default where it is installed) or asyncio's own loop.

    uvloop cut serve's and the agents' CPU per job by 5-13 % in the
    throughput bench; ``asyncio`` is there for debugging and odd platforms.
    """
    choice = (os.environ if env is None else env).get("GPUQ_EVENT_LOOP", "auto").strip().lower() or "auto"
    if choice not in EVENT_LOOPS:
        raise ConfigError(f"GPUQ_EVENT_LOOP: {choice!r} is not one of {', '.join(EVENT_LOOPS)}")
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
    """``anyio.run`` for the long-running commands (serve, sweep, agent, dev), on the loop
    ``GPUQ_EVENT_LOOP`` picks."""
    import anyio

    return anyio.run(fn, *args, backend_options={"use_uvloop": use_uvloop()})


def parse_tokens(text: str) -> frozenset[str]:
    tokens = frozenset(t.strip() for t in text.split(",") if t.strip())
    if not tokens:
        raise ConfigError("GPUQ_TOKENS is set but holds no token")
    return tokens


def _int(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise ConfigError(f"{name}: {text!r} is not an integer") from None
