"""Lease cursors, the settled horizon and the floors: pure bookkeeping, no I/O.

docs/design.md, "Lease cursors": a group's lease starts each kind at its
cursor (priority, id), not at the top of the pending index, so dead index
entries behind it (an old snapshot keeps them) cost nothing. The rules:

- a cursor may only pass ids that are *settled* (every id up to it committed
  or rolled back); a horizon (the last id drawn, and the transactions then
  writing jobs) becomes settled once those writers have ended;
- a notification drops a kind's cursor when its jobs land behind it (a top
  priority above the cursor's, or jobs moved back: no priority);
- every ``rewind_polls`` polls (every poll while polling only) all cursors go;
- inserts above a kind's *floor* (the priority its cursor reached, recorded in
  gpuq.lease_floors) notify; when a floor goes down the kind starts from the
  top at once, and again as each transaction that was writing jobs then ends
  (it read the old floor and did not notify).

The dispatcher does the reads and writes these methods ask for and hands the
answers back.
"""

from __future__ import annotations

from collections.abc import Mapping

Cursor = tuple[int, int]  # (priority, id) where a kind's next lease starts


class Cursors:
    def __init__(self, now: float) -> None:
        self.cursors: dict[str, Cursor] = {}
        self.since = now  # when they were last all dropped
        self.rewinds = 0  # cursors dropped by notifications so far
        # Every job id up to ``settled`` committed or rolled back: cursors may pass it.
        self.settled = 0
        self.horizon: tuple[int, list[str]] | None = None  # a newer candidate and its writers
        self._settle_at = 0.0
        self.floors: dict[str, int] = {}  # kind -> priority recorded in gpuq.lease_floors
        # Floors lowered (or new): kinds to start from the top once these writers have ended.
        self.confirm: list[tuple[set[str], list[str]]] = []

    # -- what each pass and each notification does to them -----------------

    def announced(self, kind: str, top: int | None) -> None:
        """A notification: jobs of ``kind`` up to priority ``top`` (None: moved back, anywhere)."""
        cursor = self.cursors.get(kind)
        if top is None or (cursor is not None and top > cursor[0]):
            self.cursors.pop(kind, None)  # jobs behind it: start that kind from the top
            self.rewinds += 1

    def start_pass(self, now: float, rewind_all: bool, rewind_every: float) -> None:
        """Drop every cursor when asked to, or when they are older than ``rewind_every``."""
        if rewind_all or now - self.since > rewind_every:
            self.cursors.clear()
            self.since = now

    def leased(self, moved_to: Mapping[str, Cursor], rewinds_before: int) -> dict[str, int]:
        """A lease moved these cursors; returns the floors to record (kind -> priority).

        A drop that arrived during the lease (``rewinds`` moved on) wins: the
        lease's cursors are not kept then.
        """
        if rewinds_before != self.rewinds:
            return {}
        self.cursors.update(moved_to)
        return {k: p for k, (p, _id) in moved_to.items() if self.floors.get(k) != p}

    def floors_recorded(self, moved: Mapping[str, int]) -> set[str]:
        """The floors are written; returns the kinds whose floor went down (or is new): rewound now."""
        lowered = {k for k, p in moved.items() if k not in self.floors or p < self.floors[k]}
        self.floors.update(moved)
        self.rewind(lowered)
        return lowered

    def confirm_after(self, lowered: set[str], writers: list[str]) -> None:
        """Rewind ``lowered`` again as each of ``writers`` (writing jobs when the floors moved) ends."""
        if lowered and writers:
            self.confirm.append((lowered, writers))

    def confirm_writers(self) -> list[str]:
        return sorted({x for _kinds, writers in self.confirm for x in writers})

    def writers_running(self, running: set[str]) -> set[str]:
        """Of the writers to confirm, these still run: returns the kinds to rewind (some ended)."""
        rewound: set[str] = set()
        pending = []
        for kinds, writers in self.confirm:
            left = [x for x in writers if x in running]
            if len(left) < len(writers):  # what the ended ones inserted has committed
                rewound |= kinds
            if left:
                pending.append((kinds, left))
        self.confirm = pending
        self.rewind(rewound)
        return rewound

    def rewind(self, kinds: set[str]) -> None:
        for kind in kinds:
            self.cursors.pop(kind, None)

    def restart(self, now: float) -> None:
        """A new LISTEN connection, maybe to another server (a failover): the floors recorded under
        the old one are gone, and the settled id and the writers it waited for were the old
        server's. Start afresh: no cursor, nothing settled until a new horizon settles."""
        self.floors.clear()
        self.confirm.clear()
        self.cursors.clear()
        self.since = now
        self.settled, self.horizon, self._settle_at = 0, None, 0.0

    # -- the settled horizon ---------------------------------------------------

    def settle_due(self, now: float, every: float) -> bool:
        """Whether to look for a newer settled id now (at most every ``every`` seconds)."""
        if now < self._settle_at:
            return False
        self._settle_at = now + every
        return True

    def horizon_writers(self) -> list[str]:
        """The writers the current horizon waits for (none: nothing pending, or it settles now)."""
        return self.horizon[1] if self.horizon is not None else []

    def horizon_ended(self) -> None:
        """The horizon's writers have ended: every id up to it is settled."""
        if self.horizon is not None:
            self.settled = max(self.settled, self.horizon[0])
            self.horizon = None

    def new_horizon(self, last_id: int, writers: list[str]) -> None:
        """The last id drawn now, and the transactions writing jobs now."""
        if writers:
            self.horizon = (last_id, writers)
        else:
            self.settled, self.horizon = max(self.settled, last_id), None
