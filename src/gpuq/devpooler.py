"""A throwaway PgBouncer in transaction mode in front of a PostgreSQL, for tests and benches.

Like the embedded cluster (``devdb``), it runs as an unprivileged user when we
are root (PgBouncer refuses root), listens on 127.0.0.1 only, and says which
package to install when the binary is missing.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from gpuq.devdb import DevDBError, _drop_privileges, _server_user, free_port

INSTALL_HINT = "PgBouncer is not installed: apt-get install pgbouncer"


def find_pgbouncer() -> str:
    found = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None)
    if found is None:
        raise DevDBError(INSTALL_HINT)
    return found


@dataclass
class Bouncer:
    """``pool_mode = transaction`` in front of the server of ``dsn`` (its user is trusted)."""

    dsn: str
    port: int = field(default_factory=free_port)
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="gpuq-bouncer-")))
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """``dsn`` with its host and port swapped for the pooler's."""
        parts = urlsplit(self.dsn)
        user = parts.username or "gpuq"
        return f"postgresql://{user}@127.0.0.1:{self.port}{parts.path}"

    def start(self) -> Bouncer:
        binary = find_pgbouncer()
        parts = urlsplit(self.dsn)
        user = _server_user()
        (self.workdir / "users.txt").write_text(f'"{parts.username or "gpuq"}" ""\n')
        (self.workdir / "pgbouncer.ini").write_text(f"""[databases]
* = host={parts.hostname or "127.0.0.1"} port={parts.port or 5432}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {self.port}
unix_socket_dir =
auth_type = trust
auth_file = {self.workdir / "users.txt"}
pool_mode = transaction
max_client_conn = 1000
default_pool_size = 20
logfile = {self.workdir / "pgbouncer.log"}
""")
        if user is not None:
            pw = pwd.getpwnam(user)
            for path in (self.workdir, *self.workdir.iterdir()):
                os.chown(path, pw.pw_uid, pw.pw_gid)
        self.proc = subprocess.Popen([binary, str(self.workdir / "pgbouncer.ini")], cwd="/",
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                     **_drop_privileges(user))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise DevDBError(f"pgbouncer exited ({self.proc.returncode}): {self.log_tail()}")
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            time.sleep(0.05)
        raise DevDBError(f"pgbouncer did not listen on port {self.port}: {self.log_tail()}")

    def log_tail(self, lines: int = 10) -> str:
        try:
            return "\n".join((self.workdir / "pgbouncer.log").read_text().splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.workdir, ignore_errors=True)
