"""The dispatcher's timing knobs: named defaults, one object (River's ``*Default`` constants).

They are not settings an operator chooses (those are in ``gpuq.config``): each
is a trade-off measured once and written down here. Tests that need a shorter
or longer one pass a ``Tuning`` to ``serve()`` or ``Dispatcher``, never patch a
module global.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpuq.db import LISTEN_PROBE_SECONDS
from gpuq.protocol import server_side

# How long one arm of the wake-up mark asks producers to NOTIFY; an idle
# dispatcher arms again when half of it is left. Also how long producers keep
# notifying after every dispatcher got busy: 1 s cost them 10 % of their commits.
WAKE_MARK_MS_DEFAULT = 100
# How often a dispatcher that found stragglers checks whether they have ended.
STRAGGLER_POLL_SECONDS_DEFAULT = 0.001
# Cursors start from the top again every this many polls: what no notification
# announces (rows another lease skipped while locked, a job inserted above a
# floor while the floor moved) waits at most this long. Poll-only: every poll.
REWIND_POLLS_DEFAULT = 10
# How often the dispatcher looks for a newer settled id (docs/design.md, "Lease cursors").
SETTLE_SECONDS_DEFAULT = 0.01
# How often, at most, it reads gpuq.shapes for placement classes new since the last read.
SHAPES_SECONDS_DEFAULT = 0.05
# How often, at most, it reads the tenants' weights (whether fair share is on, so whether outcomes
# charge usage): a change reaches a busy dispatcher's charging within this.
FAIR_SHARE_SECONDS_DEFAULT = 1.0
# While fair share is on, how many tenants without known work each lease also tries (rotating):
# one that comes back is leased at once when it is among them, else at the next read.
FAIR_PROBES_DEFAULT = 8
# While fair share is on, how often at most a notification has the tenants with work read again
# (a loose scan: one descent per kind, shape and tenant with work).
FAIR_WAITING_SECONDS_DEFAULT = 0.05
# How often it asks how long each multi-GPU shape's next job has waited (for reservations).
RESERVE_CHECK_SECONDS_DEFAULT = 1.0
# How often, at most, it looks for preemptible jobs to preempt for GPU shapes that found no room (or plain jobs no slot).
PREEMPT_CHECK_SECONDS_DEFAULT = 0.25
# Placement across servers (gpuq.fleet_agents, dispatcher/roster.py): how often a server marks
# its agents' rows seen; after how long without that another server's rows stop counting (and
# are pruned: it crashed or lost the database); how often, at most, it reads the others' rows.
FLEET_REFRESH_SECONDS_DEFAULT = 2.0
FLEET_STALE_SECONDS_DEFAULT = 10.0
FLEET_READ_SECONDS_DEFAULT = 0.1
# A job's progress is written at most this often.
PROGRESS_WRITE_SECONDS_DEFAULT = 1.0
# The most a stop (after its drain deadline) or a disconnected agent waits on the database to
# commit outcomes and give jobs back: a hung database must not hold SIGTERM. What is not written
# by then is left to lease expiry (the sweeper), nothing else.
SHUTDOWN_DB_SECONDS_DEFAULT = 5.0
# How long the LISTEN connection may stay silent before it is asked something (bounded by
# the command timeout): a hung one is found within this plus GPUQ_COMMAND_TIMEOUT.
LISTEN_PROBE_SECONDS_DEFAULT = LISTEN_PROBE_SECONDS


@dataclass(frozen=True)
class Tuning:
    wake_mark_ms: int = WAKE_MARK_MS_DEFAULT
    straggler_poll_seconds: float = STRAGGLER_POLL_SECONDS_DEFAULT
    rewind_polls: int = REWIND_POLLS_DEFAULT
    settle_seconds: float = SETTLE_SECONDS_DEFAULT
    shapes_seconds: float = SHAPES_SECONDS_DEFAULT
    reserve_check_seconds: float = RESERVE_CHECK_SECONDS_DEFAULT
    preempt_check_seconds: float = PREEMPT_CHECK_SECONDS_DEFAULT
    fair_share_seconds: float = FAIR_SHARE_SECONDS_DEFAULT
    fair_probes: int = FAIR_PROBES_DEFAULT
    fair_waiting_seconds: float = FAIR_WAITING_SECONDS_DEFAULT
    progress_write_seconds: float = PROGRESS_WRITE_SECONDS_DEFAULT
    fleet_refresh_seconds: float = FLEET_REFRESH_SECONDS_DEFAULT
    fleet_stale_seconds: float = FLEET_STALE_SECONDS_DEFAULT
    fleet_read_seconds: float = FLEET_READ_SECONDS_DEFAULT
    shutdown_db_seconds: float = SHUTDOWN_DB_SECONDS_DEFAULT
    listen_probe_seconds: float = LISTEN_PROBE_SECONDS_DEFAULT
    # The connection rules' own defaults (protocol/server_side.py), for the server to pass on.
    hello_timeout_seconds: float = server_side.HELLO_TIMEOUT_SECONDS
    max_errors_per_connection: int = server_side.MAX_ERRORS_PER_CONNECTION


TUNING_DEFAULT = Tuning()
