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
  same faults. One the database refuses is logged and dropped, never retried
  forever;
- every ``reread_seconds`` it reads its agents' quarantine again (one small
  statement): a notification missed (LISTEN lost, or a server that only
  polls) costs at most that.

``on_change(session, freed)`` tells the dispatcher a session's quarantine
changed (``freed``: a device may take work again: a pass is due).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import anyio
import asyncpg

from gpuq import db, logs, quarantine
from gpuq.dispatcher.sessions import AgentSession
from gpuq.dispatcher.tuning import Tuning
from gpuq.dispatcher.writer import Writer
from gpuq.loops import Outage, run_every
from gpuq.protocol import DeviceFault

log = logs.get("dispatcher")
_READ_ERRORS: tuple[type[BaseException], ...] = (*db.RETRYABLE_ERRORS, TimeoutError)


class Quarantine(Writer):
    failed_event = "quarantine.write_failed"

    def __init__(self, pool: Any, policy: quarantine.Policy, sessions: Iterable[AgentSession],
                 on_change: Callable[[AgentSession, bool], None], tuning: Tuning):
        super().__init__()
        self.pool, self.policy, self._sessions, self._on_change = pool, policy, sessions, on_change
        self.read_seconds = tuning.shutdown_db_seconds  # the most admit() waits for the database
        self.reread_seconds = tuning.fleet_refresh_seconds
        self._faults: list[tuple[str, DeviceFault]] = []  # (agent name, fault) not written yet
        self._reread: set[str] = set()  # agent names whose quarantine to read again

    async def run(self) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: run_every(self.reread_seconds, self._reread_all, errors=db.RETRYABLE_ERRORS,
                                            outage=Outage(log, "quarantine.read_failed")))
            await super().run()

    async def _reread_all(self) -> None:
        if names := {s.name for s in self._sessions if s.protocol.ledger.devices}:
            self._reread |= names
            self.wake()

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
            try:
                now = await quarantine.record_fault(self.pool, name, list(fault.devices), fault.source,
                                                    fault.error, fault.job, self.policy)
            except db.RETRYABLE_ERRORS:
                raise
            except asyncpg.PostgresError as exc:  # never: every field was checked
                log.error("device.fault_refused", agent=name, devices=list(fault.devices), error=str(exc))
                now = {}
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
