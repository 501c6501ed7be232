"""The events the server's side of the protocol (``protocol/server_side.py``) hands the dispatcher:
what a connection's frames mean for the queue, only for jobs the connection holds."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuq.protocol.messages import (
    CheckpointItem,
    DeviceFault,
    Error,
    Hello,
    Outcome,
    ProgressUpdate,
)
from gpuq.protocol.slots import SlotReport

__all__ = ["AgentUpdated", "CheckpointsReceived", "DeviceFaulted", "DrainRequested", "Event", "FrameRefused",
           "HeartbeatReceived", "HelloReceived", "JobsReleased", "OutcomesReceived", "ProgressReceived",
           "SlotsReported"]


@dataclass(frozen=True, slots=True)
class HelloReceived:
    hello: Hello


@dataclass(frozen=True, slots=True)
class OutcomesReceived:
    """Outcomes to persist, each with its job's kind ('?' when not held here); ``freed`` credits;
    ``ran``: seconds each job ran from its ``started`` (version 5) to its outcome, as received."""

    outcomes: list[tuple[Outcome, str]]
    freed: int
    ran: dict[int, float]
    # Failed jobs this connection held with devices: id -> (lease token, those devices).
    failed_on: dict[int, tuple[str, tuple[int, ...]]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class HeartbeatReceived:
    ids: tuple[int, ...]  # only jobs this connection holds


@dataclass(frozen=True, slots=True)
class DrainRequested:
    pass


@dataclass(frozen=True, slots=True)
class AgentUpdated:
    """Labels or warm models changed (version 4): placement may now differ."""


@dataclass(frozen=True, slots=True)
class ProgressReceived:
    updates: tuple[ProgressUpdate, ...]  # only jobs this connection holds, with their lease token


@dataclass(frozen=True, slots=True)
class CheckpointsReceived:
    """Version 9: checkpoints to store, only of jobs this connection holds with that lease token;
    answer them with ``send_checkpointed`` once written."""

    items: tuple[CheckpointItem, ...]


@dataclass(frozen=True, slots=True)
class JobsReleased:
    """Version 5: held jobs the agent will not start, ``(id, lease_token)``: back to pending now,
    their attempt not counted; they no longer take credit."""

    jobs: tuple[tuple[int, str], ...]


@dataclass(frozen=True, slots=True)
class SlotsReported:
    """Version 6: the agent's busy time and gaps since its last report (for the gap histogram)."""

    report: SlotReport


@dataclass(frozen=True, slots=True)
class DeviceFaulted:
    """Version 9: the agent says these devices of its hello are bad (the quarantine counts it)."""

    fault: DeviceFault


class FrameRefused(Error):
    """A frame got this ``error`` (or, for the same reason, closed the connection): for metrics and logs."""

    __slots__ = ()


Event = (HelloReceived | OutcomesReceived | HeartbeatReceived | DrainRequested | ProgressReceived | AgentUpdated
         | JobsReleased | SlotsReported | DeviceFaulted | FrameRefused | CheckpointsReceived)
