"""Schema migrations: plain SQL files in ``migrations/``, applied in order.

Each file runs in its own transaction; a session advisory lock makes
concurrent migrators take turns; ``gpuq.schema_migrations`` records what was
applied with a checksum, so a changed file that was already applied is an
error rather than a silent drift.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from gpuq import config
from gpuq.db import connect
from gpuq.sql import queries

# Arbitrary constant: "gpuq" in ASCII. Held for the whole run.
LOCK_KEY = 0x67707571
FILE_PATTERN = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")


class MigrationError(RuntimeError):
    pass


@dataclass(frozen=True)
class Migration:
    version: str
    name: str
    sql: str

    @property
    def checksum(self) -> str:
        return hashlib.sha256(self.sql.encode()).hexdigest()


def migrations_dir() -> Path:
    """``$GPUQ_MIGRATIONS``, else the SQL shipped in the package (the top-level ``migrations/``)."""
    if env := config.get("migrations"):
        return Path(env)
    return Path(__file__).parent / "migrations"


def load_migrations(directory: Path | None = None) -> list[Migration]:
    directory = directory or migrations_dir()
    if not directory.is_dir():
        raise MigrationError(f"migrations directory not found: {directory} (set GPUQ_MIGRATIONS)")
    found = []
    for path in sorted(directory.glob("*.sql")):
        m = FILE_PATTERN.match(path.name)
        if not m:
            raise MigrationError(f"bad migration file name {path.name!r}: expected NNNN_name.sql")
        found.append(Migration(m.group(1), path.name, path.read_text()))
    versions = [m.version for m in found]
    if len(set(versions)) != len(versions):
        raise MigrationError(f"duplicate migration versions in {directory}")
    return found


async def migrate(dsn: str, directory: Path | None = None) -> list[str]:
    """Apply every migration not yet applied; return the names applied now."""
    wanted = load_migrations(directory)
    conn = await connect(dsn, direct=True, command_timeout=None)  # the lock is a session's; DDL takes its time
    try:
        await conn.execute(queries["migrations_lock"], LOCK_KEY)
        try:
            await conn.execute(queries["migrations_bootstrap"])
            applied = await _applied(conn)
            done = []
            for mig in wanted:
                if mig.version in applied:
                    if applied[mig.version] != mig.checksum:
                        raise MigrationError(
                            f"migration {mig.name} was changed after it was applied "
                            f"(checksum mismatch); add a new migration instead"
                        )
                    continue
                async with conn.transaction():
                    await conn.execute(mig.sql)
                    await conn.execute(queries["migration_record"], mig.version, mig.name, mig.checksum)
                done.append(mig.name)
            return done
        finally:
            await conn.execute(queries["migrations_unlock"], LOCK_KEY)
    finally:
        await conn.close()


async def pending_migrations(conn: asyncpg.Connection, directory: Path | None = None) -> list[str]:
    """Names of migrations not yet applied to this database (empty = up to date)."""
    exists = await conn.fetchval(queries["migrations_tracked"])
    applied = await _applied(conn) if exists else {}
    return [m.name for m in load_migrations(directory) if m.version not in applied]


async def _applied(conn: asyncpg.Connection) -> dict[str, str]:
    rows = await conn.fetch(queries["migrations_applied"])
    return {r["version"]: r["checksum"] for r in rows}
