"""The dispatcher's side of the quarantine of bad GPUs: faults written, quarantines applied.

It owns what this server knows of the quarantine (the rule: ``gpuq.quarantine``):

- each connected agent's quarantined devices, in its ledger
  (``ledger.quarantined``): read before the agent is registered (``admit``),
  so a quarantined device never gets a job between its agent's hello and the
  read; read again when a notification says the agent's quarantine changed
  (a fault on another server, an admin's clear);
- the faults agents report (protocol 9), written in the background: the
  server's reader never waits on the database. The statement decides in one
  step whether the device is now quarantined, so every server counts the
  same faults.

``on_change(session, freed)`` tells the dispatcher a session's quarantine
changed (``freed``: a device may take work again: a pass is due).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import anyio

from gpuq import db, logs, quarantine
from gpuq.dispatcher.sessions import AgentSession
from gpuq.dispatcher.writer import Writer
from gpuq.protocol import DeviceFault

log = logs.get("dispatcher")
_READ_ERRORS: tuple[type[BaseException], ...] = (*db.RETRYABLE_ERRORS, TimeoutError)


class Quarantine(Writer):
    failed_event = "quarantine.write_failed"

    def __init__(self, pool: Any, policy: quarantine.Policy, sessions: Iterable[AgentSession],
                 on_change: Callable[[AgentSession, bool], None], read_seconds: float = 5.0):
        super().__init__()
        self.pool, self.policy, self._sessions, self._on_change = pool, policy, sessions, on_change
        self.read_seconds = read_seconds  # the most admit() waits for the database
        self._faults: list[tuple[str, DeviceFault]] = []  # (agent name, fault) not written yet
        self._reread: set[str] = set()  # agent names whose quarantine to read again

    async def admit(self, session: AgentSession) -> None:
        """Read the quarantine of a connecting agent's devices before it is given work. Bounded:
        a database that does not answer leaves it to the background (``changed``)."""
        if not session.protocol.ledger.devices:
            return
        try:
            with anyio.fail_after(self.read_seconds):
                found = await quarantine.of_agents(self.pool, [session.name])
        except _READ_ERRORS as exc:
            log.warning("quarantine.read_failed", agent=session.id, error=str(exc) or type(exc).__name__)
            self.changed(session.name)
            return
        self._apply(session, found[session.name])

    def fault(self, session: AgentSession, fault: DeviceFault) -> None:
        """An agent reported bad devices: written (and perhaps quarantined) in the background."""
        log.warning("device.fault", agent=session.id, devices=list(fault.devices), source=fault.source,
                    job_id=fault.job, error=fault.error[:200])
        quarantined = session.protocol.ledger.quarantined
        if devices := tuple(i for i in fault.devices if i not in quarantined):  # those are out already
            self._faults.append((session.name, DeviceFault(devices, fault.source, fault.error, fault.job)))
            self.wake()

    def changed(self, agent: str) -> None:
        """The quarantine of agents named ``agent`` changed (a notification): read it again."""
        self._reread.add(agent)
        self.wake()

    async def write(self) -> None:
        while self._faults:  # one at a time: a failure keeps the rest queued
            name, fault = self._faults[0]
            now = await quarantine.record_fault(self.pool, name, list(fault.devices), fault.source, fault.error,
                                                fault.job, self.policy)
            del self._faults[0]
            for index, reason in now.items():
                log.warning("device.quarantined", agent=name, device=index, reason=reason)
            if now:
                self._reread.add(name)
        if not self._reread:
            return
        names, self._reread = self._reread, set()
        try:
            found = await quarantine.of_agents(self.pool, sorted(names))
        except BaseException:
            self._reread |= names
            raise
        for session in self._sessions:
            if session.name in found:
                self._apply(session, found[session.name])

    def _apply(self, session: AgentSession, devices: dict[int, str]) -> None:
        ledger = session.protocol.ledger
        known = {d.index for d in ledger.devices}
        devices = {i: reason for i, reason in devices.items() if i in known}
        if devices == ledger.quarantined:
            return
        freed = bool(ledger.quarantined.keys() - devices.keys())
        ledger.quarantined = devices
        log.info("agent.quarantine", agent=session.id, quarantined=sorted(devices))
        self._on_change(session, freed)
