"""The embedded PostgreSQL: found, started as an unprivileged user, stopped cleanly."""

import os

import asyncpg
import pytest

from gpuq import devdb
from gpuq.devdb import DevDBError, find_bindir


def test_missing_server_binaries_name_the_package(tmp_path, monkeypatch):
    monkeypatch.delenv("GPUQ_PG_BINDIR", raising=False)
    with pytest.raises(DevDBError, match="apt-get install postgresql"):
        find_bindir([str(tmp_path), "/nonexistent"])


def test_a_wrong_bindir_setting_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("GPUQ_PG_BINDIR", str(tmp_path))
    with pytest.raises(DevDBError, match="GPUQ_PG_BINDIR"):
        find_bindir()


def test_the_installed_binaries_are_found(monkeypatch):
    monkeypatch.delenv("GPUQ_PG_BINDIR", raising=False)
    assert (find_bindir() / "initdb").is_file()


async def test_cluster_lifecycle_as_an_unprivileged_server():
    cluster = devdb.throwaway_cluster()
    try:
        dsn = cluster.ensure_started()
        conn = await asyncpg.connect(dsn)
        try:
            server_user = await conn.fetchval(
                "SELECT pg_catalog.pg_get_userbyid(datdba) FROM pg_database WHERE datname = 'postgres'"
            )
            assert server_user == "gpuq"
            fsync = await conn.fetchval("SHOW fsync")
            assert fsync == "off"  # throwaway clusters run without durability
        finally:
            await conn.close()
        if os.geteuid() == 0:
            owner = os.stat(cluster.data_dir).st_uid
            assert owner != 0  # the data belongs to the unprivileged server user
        assert cluster.ensure_started() == dsn  # idempotent: already running
        cluster.stop()
        assert not cluster.is_running()
        dsn2 = cluster.ensure_started()  # restarts the existing data directory
        conn = await asyncpg.connect(dsn2)
        await conn.close()
    finally:
        cluster.destroy()
    assert not cluster.data_dir.exists()
