"""Checkpoints on the agent's side, without I/O: the queue that sends each job's latest checkpoint at
most once per interval and resolves the receipts ``job.checkpoint()`` returns (``receipts``).

The rules (docs/protocol.md, "Version 9: checkpoints"; docs/design.md, "Checkpoints"):

- a job's first checkpoint goes out at once; later ones at most once per
  ``interval`` seconds: one given sooner waits, and a newer one replaces it
  while it waits, so the latest is the one sent when the interval lapses;
- when the job ends, the one still waiting goes out at once, before the
  outcome (``finish``), whatever the interval;
- each one sent carries a number (``seq``) the server's ``checkpointed``
  answers with: its receipts then resolve, True once stored, False when
  fencing refused it; a receipt whose checkpoint was replaced resolves with
  the one that replaced it (that is what the next attempt resumes from);
- a lost connection resolves every receipt not answered False, and a
  checkpoint of a job leased on a lost connection (a sync handler still
  running) resolves False at once: the server gave the job back.

Any thread may call ``add``; the rest runs where the agent's protocol runs.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from gpuq.protocol.fields import checkpoint_item
from gpuq.protocol.frames import RESULTS_OVERHEAD, pack_checkpoints
from gpuq.protocol.receipts import Receipt

__all__ = ["DEFAULT_CHECKPOINT_SECONDS", "CheckpointQueue"]

# A job's checkpoints go out at most this often (the agent's ``checkpoint_seconds``): like progress,
# at most one write per running job per second.
DEFAULT_CHECKPOINT_SECONDS = 1.0


@dataclass
class _Job:
    """One running job's checkpoints: the one waiting for its interval, and when one last went out."""

    token: str
    sent_at: float | None = None  # on the queue's clock; None: none sent yet
    waiting: str | None = None  # data (JSON text) not sent yet
    receipts: list[Receipt] = field(default_factory=list)  # of ``waiting`` and those it replaced


class CheckpointQueue:
    """Each running job's latest checkpoint, sent at most once per ``interval`` seconds, and the
    receipts of those sent until the server answers."""

    def __init__(self, interval: float, clock: Callable[[], float]):
        if interval < 0:
            raise ValueError(f"checkpoint interval must be 0 seconds or more, not {interval}")
        self.interval = interval
        self.clock = clock
        self.enabled = False  # the connection's version takes checkpoints (set at each welcome)
        self._jobs: dict[int, _Job] = {}
        self._sent: dict[int, list[Receipt]] = {}  # seq -> the receipts its answer resolves
        self._ready: list[tuple[int, str]] = []  # (seq, item) to send in the next frames
        self._seq = 0
        self._gone: set[str] = set()  # lease tokens of jobs pushed on a lost connection
        self._asked = False  # add() asked for a due() not yet done
        self._lock = threading.Lock()

    def add(self, job_id: int, token: str, data_json: str) -> tuple[Receipt, bool]:
        """Keep ``data_json`` as the job's latest checkpoint; any thread may call it. Its receipt, and
        True when the caller must arrange a ``due()`` call: the first since the last one."""
        receipt = Receipt()
        with self._lock:
            if not self.enabled or token in self._gone:
                receipt.resolve(False)
                return receipt, False
            job = self._jobs.get(job_id)
            if job is None or job.token != token:  # (a job leased again here: the old lease is gone)
                stale = job.receipts if job is not None else []
                job = self._jobs[job_id] = _Job(token)
            else:
                stale = []
            job.waiting = data_json
            job.receipts.append(receipt)
            ask, self._asked = not self._asked, True
        for old in stale:
            old.resolve(False)
        return receipt, ask

    def due(self) -> float | None:
        """Make the checkpoints whose interval has lapsed ready to send (``frames``); the seconds
        until the next waiting one is due (None: none waits)."""
        now = self.clock()
        next_in: float | None = None
        with self._lock:
            self._asked = False
            for job_id, job in self._jobs.items():
                if job.waiting is None:
                    continue
                left = 0.0 if job.sent_at is None else job.sent_at + self.interval - now
                if left <= 0:
                    self._take(job_id, job, now)
                else:
                    next_in = left if next_in is None else min(next_in, left)
        return next_in

    def finish(self, job_id: int, token: str) -> None:
        """The job ended: its waiting checkpoint is ready to send at once (before the outcome,
        which is queued after it); the job is forgotten (what was sent still gets its answer)."""
        with self._lock:
            self._gone.discard(token)
            job = self._jobs.get(job_id)
            if job is None or job.token != token:
                return
            del self._jobs[job_id]
            if job.waiting is not None:
                self._take(job_id, job, self.clock())

    def _take(self, job_id: int, job: _Job, now: float) -> None:
        assert job.waiting is not None
        self._seq += 1
        self._sent[self._seq] = job.receipts
        self._ready.append((self._seq, checkpoint_item(job_id, job.token, self._seq, job.waiting)))
        job.waiting, job.receipts, job.sent_at = None, [], now

    def frames(self, max_frame: int) -> list[str]:
        """``checkpoint`` frames of those ready, each within ``max_frame``; one too large for a frame
        is refused here."""
        if not self._ready:  # the common case, unlocked: it is filled where this runs (loop, protocol lock)
            return []
        with self._lock:
            ready, self._ready = self._ready, []
        limit = max_frame - RESULTS_OVERHEAD - 30
        fits = [item for _, item in ready if len(item) <= limit]
        if len(fits) < len(ready):
            self.answered((), [seq for seq, item in ready if len(item) > limit])
        return pack_checkpoints(fits, max_frame) if fits else []

    def answered(self, stored: Iterable[int], refused: Iterable[int]) -> None:
        """The server's ``checkpointed``: resolve the receipts of those numbers."""
        for seqs, ok in ((stored, True), (refused, False)):
            for seq in seqs:
                with self._lock:
                    receipts = self._sent.pop(seq, [])
                for receipt in receipts:
                    receipt.resolve(ok)

    def lost(self, tokens: Iterable[str]) -> None:
        """The connection dropped: nothing waiting or sent will be stored; a checkpoint of a job
        pushed on it (``tokens``: those still running) is refused from now on."""
        with self._lock:
            receipts = [r for job in self._jobs.values() for r in job.receipts]
            receipts.extend(r for rs in self._sent.values() for r in rs)
            self._jobs, self._sent, self._ready = {}, {}, []
            self._gone = set(tokens)  # those of earlier connections ended or were given back
        for receipt in receipts:
            receipt.resolve(False)
