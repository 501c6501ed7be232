"""A throwaway primary and its streaming standby, built from the PostgreSQL binaries.

For ``gpuq bench failover`` and the tests: the primary is an embedded cluster
(``gpuq.devdb``, run as an unprivileged user when we are root) with a
replication slot; the standby is ``pg_basebackup -R`` of it, on its own port.

Synchronous: the primary's ``synchronous_standby_names`` is ``'*'``, so a
commit returns only once the standby has the WAL on disk; the standby's own
setting is cleared, so once promoted it does not wait for a standby it lacks.
Asynchronous: the primary does not wait, and what the standby had not
received when the primary died is gone.

Nothing here speaks SQL: readiness ("streaming") is the caller's to check.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuq.devdb import Cluster, DevDBError, find_bindir, throwaway_cluster

SLOT = "gpuq_standby"
# The primary's side of streaming replication (most are PostgreSQL's defaults, stated).
PRIMARY_SETTINGS = {"wal_level": "replica", "max_wal_senders": "4", "max_replication_slots": "4",
                    "hot_standby": "on"}


@dataclass
class StandbyPair:
    primary: Cluster
    standby: Cluster
    synchronous: bool

    @classmethod
    def start(cls, synchronous: bool = True) -> StandbyPair:
        """A running primary and a standby streaming from it (not yet caught up: poll
        ``pg_stat_replication``)."""
        primary = throwaway_cluster(PRIMARY_SETTINGS)
        standby = throwaway_cluster(bindir=primary.bindir)
        pair = cls(primary, standby, synchronous)
        try:
            primary.ensure_started()
            pair._base_backup()
            standby.ensure_started()
            if synchronous:
                # Commits wait for the standby from now on (it is connecting already).
                primary.configure({"synchronous_standby_names": "'*'"}, "gpuq: synchronous standby")
                primary.reload()
        except BaseException:
            pair.destroy()
            raise
        return pair

    def _base_backup(self) -> None:
        # -R: standby.signal and primary_conninfo; -C -S: a slot, so the primary keeps
        # the WAL the standby still needs; -c fast: do not wait for a spread checkpoint.
        self.standby.hand_over(self.standby.data_dir)
        self.standby.tool("pg_basebackup", "-h", "127.0.0.1", "-p", str(self.primary.port), "-U", "gpuq",
                          "-D", str(self.standby.data_dir), "-R", "-X", "stream", "-C", "-S", SLOT, "-c", "fast")
        # A copy of the primary's log is not the standby's.
        (self.standby.data_dir / "server.log").unlink(missing_ok=True)
        self.standby.configure({"synchronous_standby_names": "''"},
                               "gpuq standby: once promoted, wait for no standby of its own")

    def dsn(self, first_port: int | None = None, database: str = "postgres") -> str:
        """The multi-host DSN a deployment uses: the primary (or ``first_port``, a proxy in front
        of it) first, the standby second, only a writable one accepted."""
        first = first_port or self.primary.port
        return (f"postgresql://gpuq@127.0.0.1:{first},127.0.0.1:{self.standby.port}/{database}"
                "?target_session_attrs=read-write")

    def kill_primary(self) -> None:
        """The primary dies without a checkpoint or a goodbye (``pg_ctl stop -m immediate``)."""
        self.primary.stop("immediate")

    def promote(self) -> None:
        self.standby.promote()

    def destroy(self) -> None:
        for c in (self.standby, self.primary):
            c.destroy()


def missing_tools() -> str | None:
    """Why a standby cannot be built here (None: it can)."""
    try:
        bindir = find_bindir()
    except DevDBError as exc:
        return str(exc)
    return None if (bindir / "pg_basebackup").is_file() else f"pg_basebackup not found in {bindir}"
