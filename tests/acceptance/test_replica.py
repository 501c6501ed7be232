"""A primary and its standby from the PostgreSQL binaries (gpuq.replica), as ``gpuq bench failover`` uses them."""

import asyncpg

from gpuq.replica import StandbyPair
from tests.helpers import need_replica_tools, wait_for


async def test_a_synchronous_standby_streams_is_promoted_and_waits_for_no_standby_of_its_own():
    need_replica_tools()
    pair = StandbyPair.start(synchronous=True)
    try:
        primary = await asyncpg.connect(pair.primary.dsn)
        try:
            async def synchronous() -> bool:
                rows = await primary.fetch("SELECT state, sync_state FROM pg_stat_replication")
                return [(r["state"], r["sync_state"]) for r in rows] == [("streaming", "sync")]

            await wait_for(synchronous, timeout=30)
            await primary.execute("CREATE TABLE ledger (id int); INSERT INTO ledger VALUES (1)")
            # The multi-host DSN reaches the primary, the only writable host.
            multi = await asyncpg.connect(pair.dsn(), timeout=10)
            assert await multi.fetchval("SELECT inet_server_port()") == pair.primary.port
            await multi.close()
        finally:
            primary.terminate()
        pair.kill_primary()
        pair.promote()
        multi = await asyncpg.connect(pair.dsn(), timeout=10)
        try:
            assert await multi.fetchval("SELECT inet_server_port()") == pair.standby.port
            assert await multi.fetchval("SHOW synchronous_standby_names") == ""
            # What the primary acknowledged is there, and a commit does not wait for a standby it lacks.
            await multi.execute("INSERT INTO ledger VALUES (2)", timeout=10)
            assert await multi.fetchval("SELECT count(*) FROM ledger") == 2
        finally:
            await multi.close()
    finally:
        pair.destroy()
    assert not pair.primary.data_dir.exists() and not pair.standby.data_dir.exists()
