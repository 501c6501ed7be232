"""Sessions: the connected agents as the dispatcher sees them, and the registry of them.

The server creates one ``AgentSession`` per websocket connection; frames queued
on its sans-I/O protocol object go out when ``flush()`` wakes its writer. The
dispatcher never touches a socket.
"""

from __future__ import annotations

import itertools
import random
import secrets
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from gpuq import logs, metrics
from gpuq.protocol import Device
from gpuq.protocol.server_side import ServerProtocol

log = logs.get("dispatcher")


@dataclass(eq=False)
class AgentSession:
    """One connected agent: its protocol object holds the connection's rules and credit."""

    protocol: ServerProtocol
    flush: Callable[[], None]  # wake the connection's writer (never blocks)
    id: str = ""  # the jobs' leased_by: name + a per-connection suffix
    kinds: frozenset[str] = frozenset()
    remote: str = ""  # the peer's address

    def __post_init__(self) -> None:
        hello = self.protocol.hello
        assert hello is not None, "a session starts after the hello"
        self.name = hello.agent
        self.kinds = frozenset(hello.kinds)
        if not self.id:
            self.id = f"{self.name}#{secrets.token_hex(4)}"

    @property
    def capacity(self) -> int:
        return self.protocol.ledger.capacity

    @property
    def inflight(self) -> dict[int, tuple[str, str]]:
        """Job id -> (lease token, kind) of the jobs pushed and not yet reported."""
        return self.protocol.ledger.held

    @property
    def free(self) -> int:
        return self.protocol.ledger.free

    @property
    def devices(self) -> tuple[Device, ...]:
        """The GPUs the agent offers (protocol 4; none before) that are not quarantined: what
        placement may ever give jobs (``could_run``)."""
        quarantined = self.protocol.ledger.quarantined
        return tuple(d for d in self.protocol.ledger.devices if d.index not in quarantined)

    @property
    def version(self) -> int:
        return self.protocol.version

    @property
    def labels(self) -> frozenset[str]:
        return frozenset(self.protocol.labels)

    @property
    def models(self) -> frozenset[str]:
        """The models it holds warm: those it reported, and those of the jobs it holds (a job runs
        with its model loaded, or loading: the next job of that model should wait for it too)."""
        return frozenset(self.protocol.models).union(self.protocol.ledger.held_models.values())

    def free_devices(self, min_memory_mb: int = 0) -> list[int]:
        return self.protocol.ledger.free_devices(min_memory_mb)

    def ready_devices(self, min_memory_mb: int = 0) -> list[int]:
        return self.protocol.ledger.ready_devices(min_memory_mb)

    @property
    def batch_items(self) -> int:
        """The most jobs it takes in one handler call (protocol 7's hello ``batch``); 0: no batches."""
        return self.protocol.ledger.batch

    @property
    def draining(self) -> bool:
        return self.protocol.draining

    def has_room(self) -> bool:
        """Whether a lease pass could give it anything: credit, a free device, or a ready slot."""
        return bool(self.free or self.free_devices() or self.ready_devices())

    def send_ack(self, accepted: tuple[int, ...], rejected: tuple[int, ...]) -> None:
        self.protocol.send_ack(accepted, rejected)
        self.flush()

    def send_checkpointed(self, stored: tuple[int, ...], refused: tuple[int, ...]) -> None:
        self.protocol.send_checkpointed(stored, refused)
        self.flush()


class Sessions:
    """The agents connected to this server, by session id."""

    def __init__(self) -> None:
        self._by_id: dict[str, AgentSession] = {}

    def add(self, session: AgentSession) -> None:
        self._by_id[session.id] = session
        metrics.AGENTS.set(len(self._by_id))

    def remove(self, session: AgentSession) -> None:
        self._by_id.pop(session.id, None)
        metrics.AGENTS.set(len(self._by_id))

    def get(self, session_id: str) -> AgentSession | None:
        return self._by_id.get(session_id)

    def __contains__(self, session_id: object) -> bool:
        return session_id in self._by_id

    def __iter__(self) -> Iterator[AgentSession]:
        return iter(list(self._by_id.values()))

    def __len__(self) -> int:
        return len(self._by_id)

    def any_room(self) -> bool:
        return any(s.has_room() for s in self._by_id.values())

    def groups(self, batched: frozenset[str] = frozenset()) -> dict[frozenset[str], list[AgentSession]]:
        """The agents with free credit, grouped by the kinds they take one job at a time (one lease
        per group): an agent that takes batches gets the ``batched`` kinds only in batches."""
        groups: dict[frozenset[str], list[AgentSession]] = {}
        for s in self._by_id.values():
            kinds = group_kinds(s, batched)
            if s.free and kinds:
                groups.setdefault(kinds, []).append(s)
        return groups

    def inflight(self) -> int:
        return sum(len(s.inflight) for s in self._by_id.values())

    def cancel_running(self, ids: list[int]) -> None:
        """Jobs cancelled while leased: the agents holding them are told to stop their handlers."""
        for session in self._by_id.values():
            self.cancel_on(session.id, ids)

    def cancel_on(self, session_id: str, ids: list[int]) -> None:
        """Jobs this agent's lease of is gone: if it is still connected and holds them, it stops them."""
        session = self._by_id.get(session_id)
        if session is not None and (told := session.protocol.cancel(ids)):
            session.flush()
            log.info("job.cancel_sent", agent=session.id, job_ids=told)

    def preempt_running(self, ids: list[int], grace_seconds: float) -> None:
        """Jobs asked to yield (``gpuq.preempt``): the agents holding them are told, with the deadline."""
        for session in self._by_id.values():
            if told := session.protocol.preempt(ids, grace_seconds):
                session.flush()
                log.info("job.preempt_sent", agent=session.id, job_ids=told, grace_seconds=grace_seconds)

    def send_drain(self, deadline_seconds: float) -> None:
        for s in self._by_id.values():
            s.protocol.send_drain(deadline_seconds)
            s.flush()


def group_kinds(session: AgentSession, batched: frozenset[str]) -> frozenset[str]:
    """The kinds it takes one job at a time: its group's key (``Sessions.groups``)."""
    return session.kinds - batched if session.batch_items else session.kinds


def interleave(members: Iterable[AgentSession], limit: int) -> list[str]:
    """Each agent once per free credit, round-robin, at most ``limit`` slots."""
    shuffled = list(members)
    random.shuffle(shuffled)  # fairness among agents when there are fewer jobs than slots
    columns = [[s.id] * s.free for s in shuffled]
    slots = [sid for row in itertools.zip_longest(*columns) for sid in row if sid is not None]
    return slots[:limit]
