import asyncio
from pathlib import Path

import asyncpg
import pytest

from gpuq.migrate import MigrationError, load_migrations, migrate, pending_migrations


async def test_fresh_apply_creates_schema_and_partial_indexes(server_dsn):
    conn = await asyncpg.connect(server_dsn)
    try:
        await conn.execute("DROP SCHEMA IF EXISTS gpuq CASCADE")
        applied = await migrate(server_dsn)
        assert applied == [m.name for m in load_migrations()]
        indexes = {
            r["indexname"]: r["indexdef"]
            for r in await conn.fetch("SELECT indexname, indexdef FROM pg_indexes WHERE schemaname = 'gpuq'")
        }
        assert "WHERE ((status = 'pending'::job_status) AND (shape IS NULL))" in indexes["jobs_pending_idx"]  # 0012
        assert "(kind, ((- priority)), id)" in indexes["jobs_pending_idx"]  # migration 0004
        assert "(kind, shape, priority DESC, id) WHERE ((status = 'pending'::job_status) AND (shape IS NOT NULL))" \
            in indexes["jobs_placed_idx"]
        assert "WHERE (status = 'leased'" in indexes["jobs_leased_idx"]
        assert "WHERE (status = 'scheduled'" in indexes["jobs_scheduled_idx"]
        assert await pending_migrations(conn) == []
    finally:
        await conn.close()


async def test_reapply_is_a_noop(dsn):
    assert await migrate(dsn) == []
    conn = await asyncpg.connect(dsn)
    try:
        n = await conn.fetchval("SELECT count(*) FROM gpuq.schema_migrations")
        assert n == len(load_migrations())
    finally:
        await conn.close()


async def test_concurrent_migrators_both_succeed(server_dsn):
    conn = await asyncpg.connect(server_dsn)
    try:
        await conn.execute("DROP SCHEMA IF EXISTS gpuq CASCADE")
    finally:
        await conn.close()
    results = await asyncio.gather(*(migrate(server_dsn) for _ in range(4)))
    # Exactly one of them applied the files; the others found them applied.
    assert sorted(len(r) for r in results) == [0, 0, 0, len(load_migrations())]


async def test_tampered_applied_file_is_reported(dsn, tmp_path: Path):
    copy_migrations(tmp_path, "\n-- edited after it was applied\n")
    with pytest.raises(MigrationError, match="changed after it was applied"):
        await migrate(dsn, tmp_path)


async def test_new_file_is_applied_and_bad_names_refused(dsn, tmp_path: Path):
    copy_migrations(tmp_path)
    (tmp_path / "9999_extra.sql").write_text("CREATE TABLE gpuq.extra (x int);")
    assert await migrate(dsn, tmp_path) == ["9999_extra.sql"]
    (tmp_path / "oops.sql").write_text("SELECT 1;")
    with pytest.raises(MigrationError, match="bad migration file name"):
        await migrate(dsn, tmp_path)


async def test_failing_migration_rolls_back_whole_file(dsn, tmp_path: Path):
    copy_migrations(tmp_path)
    (tmp_path / "9998_broken.sql").write_text("CREATE TABLE gpuq.half (x int);\nSELECT no_such_fn();")
    with pytest.raises(asyncpg.PostgresError):
        await migrate(dsn, tmp_path)
    conn = await asyncpg.connect(dsn)
    try:
        assert await conn.fetchval("SELECT to_regclass('gpuq.half')") is None
        assert await pending_migrations(conn, tmp_path) == ["9998_broken.sql"]
    finally:
        await conn.close()


def test_the_package_ships_the_top_level_migrations():
    from gpuq import migrate as m

    top = Path(__file__).resolve().parents[2] / "migrations"
    shipped = Path(m.__file__).parent / "migrations"
    assert sorted(p.name for p in shipped.glob("*.sql")) == sorted(p.name for p in top.glob("*.sql"))
    assert [x.checksum for x in load_migrations(shipped)] == [x.checksum for x in load_migrations(top)]


def copy_migrations(directory: Path, suffix: str = "") -> None:
    """The shipped migrations, each with ``suffix`` appended, as files in ``directory``."""
    for mig in load_migrations():
        (directory / mig.name).write_text(mig.sql + suffix)
