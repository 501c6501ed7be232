"""Wake-ups: every reason to run a lease pass goes through one object.

As River's producer funnels notify, poll and freed slots into one fetch
trigger, ``LeaseTrigger`` collects: notifications (LISTEN on ``gpuq_jobs``), freed
credit, new agents, polls, a lost LISTEN connection, and the owed pass after
the wake-up mark lapsed. ``wait()`` returns a ``Pass``: the reasons gathered
since the last one, reset as it is taken.

The wake-up mark (docs/design.md, "Wake-ups"): producers NOTIFY only while a
dispatcher keeps the mark in the future. Before it waits with free credit the
dispatcher arms it; an arm that finds it lapsed owes a pass over every group
once the transactions that may have skipped NOTIFY (stragglers) have ended.
While passes keep finding work it polls every ``busy_poll_seconds`` and lets
the mark lapse, so busy producers stop paying for wake-ups.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import anyio

from gpuq import db, logs, metrics, wakeups
from gpuq.config import ServerConfig
from gpuq.dispatcher.tuning import Tuning
from gpuq.loops import LoopBackoff, Outage, run_every

log = logs.get("dispatcher")


@dataclass
class Pass:
    """Why a lease pass runs: what it must look at."""

    every: bool = False  # every group and shape (start, reconnect, poll, a '*' or '+')
    rewind: bool = False  # every kind from the top: drop all cursors first
    kinds: set[str] = field(default_factory=set)  # kinds announced since the last pass
    credit: set[frozenset[str]] = field(default_factory=set)  # groups whose agents freed credit
    polled: bool = False  # a poll: whether work keeps coming is decided again


class LeaseTrigger:
    def __init__(self, pool: Any, config: ServerConfig, tuning: Tuning,
                 on_kind: Callable[[str, int | None], None], on_cancel: Callable[[list[int]], None]):
        self.pool, self.config, self.tuning = pool, config, tuning
        self._on_kind = on_kind  # a kind was announced, with its top priority (None: jobs moved back)
        self._on_cancel = on_cancel  # leased jobs were cancelled
        self._wake = anyio.Event()
        self._next = Pass(every=True)  # reasons gathered for the next pass; the first looks at everything
        self.busy = False  # passes keep finding work: poll every busy_poll_seconds, let the mark lapse
        self._polled_at = 0.0  # monotonic time of the last pass over every group
        self.listening = False
        self.listen_pid: int | None = None  # our LISTEN connection's backend pid
        self.on_listen: Callable[[], Any] | None = None  # awaited after each (re)connect of LISTEN
        self.on_quarantine: Callable[[str], None] | None = None  # an agent's quarantine changed (its name)
        self.on_preempt: Callable[[list[int], float], None] | None = None  # leased jobs must yield (ids, grace)
        self._mark_seen = 0  # the mark (server ms) our last arm left; 0: none to rely on
        self._arm_at = 0.0  # monotonic: arm again from here on
        self._stragglers: list[str] = []  # transactions to see end before the owed pass
        self._owe_pass = False  # a pass over every group is due once the stragglers end

    # -- reasons ---------------------------------------------------------

    def wake(self) -> None:
        self._wake.set()

    def wake_all(self, rewind: bool = False) -> None:
        """Lease for every group on the next pass; ``rewind``: from the top of every kind."""
        self._next.every = True
        self._next.rewind = self._next.rewind or rewind
        self._wake.set()

    def recheck(self, kinds: set[str]) -> None:
        """Look at these kinds on the next pass, whatever wakes it."""
        self._next.kinds |= kinds

    def credit_freed(self, kinds: frozenset[str]) -> None:
        self._next.credit.add(kinds)
        self._wake.set()

    def found_work(self) -> None:
        self.busy = True

    def lease_failed(self) -> None:
        self._next.every = True

    def put_back(self, why: Pass) -> None:
        """A pass failed part-way: its reasons join the next one's."""
        self._next.every = self._next.every or why.every
        self._next.rewind = self._next.rewind or why.rewind
        self._next.kinds |= why.kinds
        self._next.credit |= why.credit

    def take(self, polled: bool = False) -> Pass:
        """The reasons gathered so far, for the pass about to run; wake-ups from now on trigger another."""
        taken, self._next = self._next, Pass()
        taken.polled = polled
        self._wake = anyio.Event()
        if taken.every:
            self._polled_at = time.monotonic()
        if polled:
            self.busy = False  # each poll decides again (passes woken by notifications only add)
        return taken

    # -- the wait ----------------------------------------------------------

    async def wait(self, any_room: bool, placing_wait: Callable[[], float | None]) -> Pass | None:
        """Wait for a reason to lease; None: only the mark to arm again, or stragglers to check.

        ``placing_wait``: seconds until placement has a pass due of its own
        (a throttled shapes read, a warm wait that ends), None if none.
        """
        if self._wake.is_set():
            return self.take()
        with anyio.move_on_after(_earliest(await self._wait_limit(any_room), placing_wait())) as scope:
            await self._wake.wait()
        if not scope.cancelled_caught:
            return self.take()
        if self._poll_due():
            self._next.every = True
            return self.take(polled=True)
        if placing_wait() == 0:
            return self.take()  # a throttled shapes read, or held jobs that may go cold now
        return None

    def _poll_due(self) -> bool:
        return self.busy or not self.listening or time.monotonic() - self._polled_at >= self.config.poll_seconds

    async def _wait_limit(self, any_room: bool) -> float | None:
        """How long the lease loop may wait for a wake-up (None: until one comes).

        Waiting on notifications with free credit needs a valid wake-up mark,
        and after the mark lapsed, a pass over every group once the stragglers
        have ended (docs/design.md, "Wake-ups").
        """
        if not any_room:
            return None  # only freed credit gives it something to do
        if self.busy:
            return self.config.busy_poll_seconds  # work keeps coming: poll, producers need not notify
        if not self.listening:
            return self.config.poll_seconds  # poll only (a pooled URL), or LISTEN lost
        now = time.monotonic()
        if now >= self._arm_at:
            await self._arm(now)
        if self._owe_pass:
            if self._stragglers:
                self._stragglers = await wakeups.stragglers_left(self.pool, self._stragglers)
            if self._stragglers:
                return self.tuning.straggler_poll_seconds
            self._owe_pass = False
            self._next.every = True
            self._polled_at = 0.0  # the pass is due now, even if a wake-up comes first
            return 0
        return max(0.0, min(self._arm_at, self._polled_at + self.config.poll_seconds) - now)

    async def _arm(self, now: float) -> None:
        armed = await wakeups.arm_wakeups(self.pool, self.tuning.wake_mark_ms)
        lapsed = armed.now_ms >= self._mark_seen  # producers may have skipped NOTIFY since our last arm
        metrics.WAKEUP_ARMS.labels(lapsed=str(lapsed).lower()).inc()
        self._mark_seen = armed.until
        self._arm_at = now + (armed.until - armed.now_ms) / 2000  # half the mark's life left
        if lapsed:
            self._stragglers, self._owe_pass = armed.stragglers, True

    # -- LISTEN ------------------------------------------------------------

    async def listen(self) -> None:
        """Hold one LISTEN connection, reconnected with backoff, until cancelled. Its loss and the
        failed reconnects after it are one outage: logged when it begins and when LISTEN is back."""
        outage = Outage(log, "listen.lost")
        await run_every(0.1, lambda: self._listen_once(outage), backoff=LoopBackoff(first=0.1),
                        errors=db.RETRYABLE_ERRORS, outage=outage)

    async def _listen_once(self, outage: Outage) -> None:
        """Hold one LISTEN connection until it is lost (an error: the loss is an outage)."""
        conn = None
        try:
            assert self.config.listen_url is not None
            conn = await db.connect(self.config.listen_url, direct=True)  # LISTEN needs a session
            lost = anyio.Event()
            conn.add_termination_listener(lambda _c, lost=lost: lost.set())
            await conn.add_listener(wakeups.NOTIFY_CHANNEL, self.on_notify)
            self.listen_pid = conn.get_server_pid()
            if self.on_listen is not None:
                await self.on_listen()  # floors of ours from before, and the dead's
            self._mark_seen, self._arm_at = 0, 0.0  # notifications were lost: a full handshake
            self.listening = True
            log.info("listen.connected", channel=wakeups.NOTIFY_CHANNEL)
            outage.ended()
            self.wake_all(rewind=True)  # anything inserted while we were not listening
            while not lost.is_set():
                with anyio.move_on_after(self.tuning.listen_probe_seconds):
                    await lost.wait()
                if not lost.is_set():  # a hung or half-open socket: the probe times out, we reconnect
                    await db.probe(conn)
            raise ConnectionError("the LISTEN connection was closed")
        finally:
            self.listening = False
            if conn is not None and not conn.is_closed():
                conn.terminate()

    def on_notify(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        metrics.NOTIFICATIONS.inc()
        if payload.startswith(wakeups.CANCEL_PREFIX):
            self._on_cancel(wakeups.parse_cancel(payload))
            return
        if payload.startswith(wakeups.PREEMPT_PREFIX):
            if self.on_preempt is not None:
                grace, ids = wakeups.parse_preempt(payload)
                self.on_preempt(ids, grace)
        if payload.startswith(wakeups.QUARANTINE_PREFIX):
            if self.on_quarantine is not None:
                self.on_quarantine(payload[len(wakeups.QUARANTINE_PREFIX):])
            return
        wakeup = wakeups.parse_wakeup(payload)
        if wakeup.every:
            self.wake_all(rewind=wakeup.rewind)
        for kind, top in wakeup.kinds.items():
            self._next.kinds.add(kind)
            self._on_kind(kind, top)
        self._wake.set()


def _earliest(*waits: float | None) -> float | None:
    """The shortest of some waits, None standing for forever."""
    return min((w for w in waits if w is not None), default=None)
