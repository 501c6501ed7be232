"""Fair share, as this dispatcher knows it: the tenants' weights, read from gpuq.tenants.

Fair share is on while some tenant has a weight. The completer asks ``on``
to pick its outcome statements: on, they also charge each attempt's
GPU-seconds to its tenant's usage in the same statement; off, they are the
plain ones, at today's cost (docs/design.md, "Fair share").

The weights are read when a pass looks at everything (a start, a poll, a
``*`` notification: ``gpuq tenant set`` sends one), at most every
``fair_share_seconds``: a read that the throttle holds back is due when it
lapses (``wait_left``). The lease order does not use them yet.
"""

from __future__ import annotations

import time
from typing import Any

from gpuq import admin
from gpuq.dispatcher.trigger import Pass
from gpuq.dispatcher.tuning import Tuning


class FairShare:
    def __init__(self, pool: Any, tuning: Tuning):
        self.pool, self.tuning = pool, tuning
        self.weights: dict[str, float] = {}
        self._read_at, self._stale = -tuning.fair_share_seconds, True

    @property
    def on(self) -> bool:
        """Some tenant has a weight: outcomes charge usage."""
        return bool(self.weights)

    async def refresh(self, why: Pass) -> None:
        """Read the weights if a pass over everything asked since the last read, and the throttle allows."""
        now = time.monotonic()
        self._stale = self._stale or why.every
        if self._stale and now - self._read_at >= self.tuning.fair_share_seconds:
            self.weights = await admin.tenant_weights(self.pool)
            self._read_at, self._stale = now, False

    def wait_left(self) -> float | None:
        """Seconds until a read held back by the throttle is due (None: none is)."""
        if not self._stale:
            return None
        return max(0.0, self._read_at + self.tuning.fair_share_seconds - time.monotonic())
