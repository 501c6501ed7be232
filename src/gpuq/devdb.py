"""Embedded PostgreSQL: a private cluster started from the installed server binaries.

Used by ``gpuq dev`` (a persistent cluster under ``.gpuq/``) and by the test
suite (a throwaway cluster with durability switched off). No service needs to
be running: we ``initdb`` and ``pg_ctl start`` our own server on a free
127.0.0.1 port with a private socket directory.

PostgreSQL refuses to run as root, so when we are root the server runs as an
unprivileged user (``postgres`` if it exists, else ``nobody``) and the data
directory is handed to that user.
"""

from __future__ import annotations

import glob
import hashlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpuq import config

INSTALL_HINT = (
    "PostgreSQL server binaries (initdb, pg_ctl, postgres) not found. "
    "Install them with `apt-get install postgresql` (Debian/Ubuntu), or set "
    "GPUQ_PG_BINDIR to the directory that holds them, or set DATABASE_URL to use "
    "an existing server."
)

# Settings for every embedded cluster: loopback only, enough connections for
# several dispatchers, agents and benches on one machine.
BASE_SETTINGS = {
    "listen_addresses": "'127.0.0.1'",
    "max_connections": "300",
    "shared_buffers": "256MB",
    "log_min_messages": "warning",
    "log_min_error_statement": "panic",
    # A busy queue dirties 20,000 row versions (migration 0003's vacuum
    # threshold) in about a second; the default of one look a minute lets the
    # dead index entries in front of the pending ones pile up for that long.
    "autovacuum_naptime": "1s",
}
# A throwaway cluster does not need to survive a power cut (fsync off), but it
# must survive a server crash (chaos tests restart it with -m immediate), so
# commits still wait for the WAL write: synchronous_commit stays on.
FAST_SETTINGS = {"fsync": "off", "full_page_writes": "off"}


class DevDBError(RuntimeError):
    """The embedded cluster could not be found, created, started or stopped."""


SERVER_TOOLS = ("initdb", "pg_ctl", "postgres")


def find_bindir(candidates: list[str] | None = None) -> Path:
    """Locate the directory holding initdb/pg_ctl/postgres, or raise with the install hint.

    ``$GPUQ_PG_BINDIR``, when set, is the only place looked at (so a wrong
    value is an error, not silently another server version).
    """
    if env := config.get("pg_bindir"):
        if _has_server_tools(env):
            return Path(env)
        raise DevDBError(f"GPUQ_PG_BINDIR={env} does not hold {', '.join(SERVER_TOOLS)}. {INSTALL_HINT}")
    for cand in _system_candidates() if candidates is None else candidates:
        if _has_server_tools(cand):
            return Path(cand)
    raise DevDBError(INSTALL_HINT)


def _has_server_tools(directory: str) -> bool:
    return all((Path(directory) / tool).is_file() for tool in SERVER_TOOLS)


def _system_candidates() -> list[str]:
    found: list[str] = []
    if shutil.which("pg_config"):
        try:
            out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True)
            found.append(out.stdout.strip())
        except (OSError, subprocess.CalledProcessError):
            pass
    # Debian puts the server binaries outside PATH; prefer the newest version.
    found += sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=_version_key, reverse=True)
    if initdb := shutil.which("initdb"):
        found.append(str(Path(initdb).resolve().parent))
    return found


def _version_key(path: str) -> float:
    try:
        return float(Path(path).parent.name)
    except ValueError:
        return 0.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _server_user() -> str | None:
    """The user the server runs as: None (ourselves) unless we are root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise DevDBError("running as root and no unprivileged user (postgres/nobody) exists to run PostgreSQL")


@dataclass
class Cluster:
    """One PostgreSQL cluster living in ``data_dir``."""

    data_dir: Path
    fast: bool = False
    port: int = 0
    bindir: Path = field(default_factory=find_bindir)
    user: str | None = field(default_factory=_server_user)
    socket_dir: Path | None = None
    settings: dict[str, str] = field(default_factory=dict)  # added to BASE_SETTINGS at initdb

    @property
    def dsn(self) -> str:
        return f"postgresql://gpuq@127.0.0.1:{self.port}/postgres"

    @property
    def log_file(self) -> Path:
        return self.data_dir / "server.log"

    # -- lifecycle -------------------------------------------------------

    def ensure_started(self) -> str:
        """Create the cluster if needed, start it if not running; return its DSN."""
        if not (self.data_dir / "PG_VERSION").exists():
            self._initdb()
        if self.is_running():
            self.port = self._running_port()
        else:
            self._start()
        return self.dsn

    def stop(self, mode: str = "fast") -> None:
        if self.is_running():
            self._pg_ctl("stop", "-m", mode, "-w", "-t", "60")

    def restart(self, mode: str = "fast") -> None:
        """Restart on the same port (``mode='immediate'`` simulates a crash)."""
        # -l matters: without a log file the new postmaster would inherit our
        # captured stdout and pg_ctl's caller would wait for EOF forever.
        self._pg_ctl("restart", "-m", mode, "-w", "-t", "60", "-l", str(self.log_file),
                     "-o", self._server_options())

    def destroy(self) -> None:
        """Stop the server and delete its data (throwaway clusters)."""
        self.stop("immediate")
        shutil.rmtree(self.data_dir.parent if self.fast else self.data_dir, ignore_errors=True)
        if self.socket_dir is not None:
            shutil.rmtree(self.socket_dir, ignore_errors=True)

    def is_running(self) -> bool:
        if not (self.data_dir / "postmaster.pid").exists():
            return False
        res = self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data_dir), "status"], check=False)
        return res.returncode == 0

    # -- steps -----------------------------------------------------------

    def _initdb(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._hand_over(self.data_dir)
        self._run([str(self.bindir / "initdb"), "-D", str(self.data_dir), "-U", "gpuq",
                   "--auth=trust", "-E", "UTF8", "--no-locale", "--no-instructions"])
        self.configure(dict(BASE_SETTINGS, **(FAST_SETTINGS if self.fast else {}), **self.settings),
                       "gpuq embedded cluster")

    def configure(self, settings: dict[str, str], why: str) -> None:
        """Append ``settings`` to postgresql.conf (the last line of a name wins; ``reload()`` applies)."""
        with open(self.data_dir / "postgresql.conf", "a") as conf:
            conf.write(f"\n# {why}\n")
            conf.writelines(f"{k} = {v}\n" for k, v in settings.items())

    def reload(self) -> None:
        self._pg_ctl("reload")

    def promote(self) -> None:
        """End a standby's recovery: it is a writable primary when this returns."""
        self._pg_ctl("promote", "-w", "-t", "60")

    def tool(self, name: str, *args: str) -> None:
        """Run the PostgreSQL binary ``name`` (pg_basebackup, say) as the server user."""
        if not (self.bindir / name).is_file():
            raise DevDBError(f"{name} not found in {self.bindir}. {INSTALL_HINT}")
        self._run([str(self.bindir / name), *args])

    def hand_over(self, path: Path) -> None:
        """Create ``path`` for the server user (a data directory another tool fills)."""
        path.mkdir(parents=True, exist_ok=True)
        self._hand_over(path)

    def _start(self) -> None:
        if not self.port:
            self.port = free_port()
        if self.socket_dir is None:
            # Unix socket paths are limited to ~107 bytes: keep it short, in /tmp.
            self.socket_dir = Path(tempfile.mkdtemp(prefix="gpuq-sock-"))
            self._hand_over(self.socket_dir)
        try:
            self._pg_ctl("start", "-w", "-t", "60", "-l", str(self.log_file), "-o", self._server_options())
        except DevDBError as exc:
            raise DevDBError(f"{exc}\n{self._log_tail()}") from None

    def _server_options(self) -> str:
        return f"-p {self.port} -k {self.socket_dir}"

    def _running_port(self) -> int:
        # Line 4 of postmaster.pid is the port the running server listens on.
        lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        return int(lines[3])

    def _pg_ctl(self, *args: str) -> None:
        self._run([str(self.bindir / "pg_ctl"), "-D", str(self.data_dir), *args])

    def _hand_over(self, path: Path) -> None:
        """Give a directory to the server user so an unprivileged server can use it."""
        if self.user is None:
            return
        pw = pwd.getpwnam(self.user)
        os.chown(path, pw.pw_uid, pw.pw_gid)
        path.chmod(0o700)
        probe = self._run(["test", "-w", str(path)], check=False)
        if probe.returncode != 0:
            raise DevDBError(
                f"PostgreSQL runs as user {self.user!r} (it refuses root) but that user cannot "
                f"reach {path}: make its parent directories world-traversable (chmod o+x) or "
                f"choose another location."
            )

    def _run(self, cmd: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, cwd="/", env=_server_env(),
                                 **_drop_privileges(self.user))
        except OSError as exc:
            raise DevDBError(f"cannot run {cmd[0]}: {exc}") from None
        if check and res.returncode != 0:
            raise DevDBError(f"{Path(cmd[0]).name} failed: {(res.stderr or res.stdout).strip()}")
        return res

    def _log_tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log_file.read_text().splitlines()[-lines:])
        except OSError:
            return ""


def _drop_privileges(user: str | None) -> dict[str, Any]:
    if user is None:
        return {}
    pw = pwd.getpwnam(user)
    return {"user": pw.pw_uid, "group": pw.pw_gid, "extra_groups": []}


def _server_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    env["LC_ALL"] = "C"
    return env


def throwaway_cluster(settings: dict[str, str] | None = None, bindir: Path | None = None) -> Cluster:
    """A fast, disposable cluster in a fresh temporary directory (for tests and benches)."""
    root = Path(tempfile.mkdtemp(prefix="gpuq-pg-"))
    root.chmod(0o755)
    return Cluster(root / "data", fast=True, bindir=bindir or find_bindir(), settings=dict(settings or {}))


def dev_cluster(base: Path | None = None) -> Cluster:
    """The persistent development cluster under ``.gpuq/`` (data kept across runs).

    When we are root and the unprivileged server user cannot reach ``.gpuq/``
    (a checkout under /root, say, is mode 700), the data lives in
    /var/tmp/gpuq-dev-<hash of the path> and ``.gpuq/pgdata`` is a symlink to it.
    """
    base = (base or Path.cwd() / ".gpuq").resolve()
    base.mkdir(parents=True, exist_ok=True)
    base.chmod(0o755)
    data = base / "pgdata"
    user = _server_user()
    if user is not None and not data.exists() and not data.is_symlink() and not _user_can_reach(user, base):
        digest = hashlib.sha256(str(base).encode()).hexdigest()[:12]
        target = Path("/var/tmp") / f"gpuq-dev-{digest}" / "pgdata"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.parent.chmod(0o755)
        data.symlink_to(target, target_is_directory=True)
    return Cluster(data.resolve())


def _user_can_reach(user: str, path: Path) -> bool:
    res = subprocess.run(["test", "-x", str(path)], capture_output=True, cwd="/", **_drop_privileges(user))
    return res.returncode == 0
