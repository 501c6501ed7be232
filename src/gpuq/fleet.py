"""The fleet read model: the agents connected to this server, their GPUs, how busy they are,
and the jobs none of them can run. One source for ``/status``, ``gpuq status --server``
(which reads ``/status``) and the dashboard; it reads the dispatcher's parts and changes nothing.
"""

from __future__ import annotations

import time
from typing import Any

from gpuq import admin, quarantine
from gpuq.dispatcher import AgentSession, Dispatcher
from gpuq.latency import JobLatency
from gpuq.protocol import slots
from gpuq.protocol.ledger import device_status


class Fleet:
    def __init__(self, dispatcher: Dispatcher):
        self._d = dispatcher

    @property
    def pool(self) -> Any:
        """The database the dashboard's own reads go to."""
        return self._d.pool

    @property
    def latency(self) -> JobLatency:
        return self._d.latency

    @property
    def agent_count(self) -> int:
        return len(self._d.sessions)

    def agents(self) -> list[dict[str, Any]]:
        """Every connected agent, as an operator reads it, by id."""
        now = time.monotonic()
        return sorted((self._agent(s, now) for s in self._d.sessions), key=lambda a: a["agent"])

    def _agent(self, s: AgentSession, now: float) -> dict[str, Any]:
        proto = s.protocol
        placing = self._d.placing
        reserved = placing.reserved.get(s.id)
        shape = placing.shapes.get(reserved) if reserved else None
        beat = proto.last_heartbeat
        return {"agent": s.id, "kinds": sorted(s.kinds), "capacity": s.capacity, "prefetch": proto.ledger.prefetch,
                "batch": proto.ledger.batch,
                "inflight": len(s.inflight), "unstarted": len(proto.ledger.unstarted()),
                "busy_fraction": slots.busy_fraction(*proto.ledger.busy.totals(now)),
                "draining": s.draining, "protocol": proto.version, "remote": s.remote, "devices": device_status(proto.ledger),
                "labels": list(proto.labels), "models": list(proto.models),
                "last_heartbeat_seconds": None if beat is None else round(now - beat, 3),
                "reserved_for": {"kind": shape.kind, "gpus": shape.gpus} if shape else None,
                "progress": {str(i): p for i, p in self._d.progress.of(s.inflight).items()}}

    def busy(self) -> dict[str, Any]:
        """The fleet's busy fraction over the last minute: handler time over handler time plus the
        idle gaps while work waited, as this server's protocol 6 agents reported them."""
        now = time.monotonic()
        busy = idle = 0.0
        for s in self._d.sessions:
            b, i = s.protocol.ledger.busy.totals(now)
            busy, idle = busy + b, idle + i
        return {"busy_fraction": slots.busy_fraction(busy, idle), "busy_seconds": round(busy / 1000, 3),
                "gap_seconds": round(idle / 1000, 3), "window_seconds": slots.BUSY_WINDOW_SECONDS}

    async def unplaceable(self) -> dict[str, list[dict[str, Any]]]:
        """Pending placed jobs no agent could run, per kind, with the reason: this server's agents and
        every other server's (gpuq.fleet_agents, within its staleness bound)."""
        return await self._d.placing.unplaceable(list(self._d.sessions))

    def inflight_by_kind(self) -> dict[str, int]:
        """Jobs this server's agents hold (pushed, not yet reported) per kind: every kind a connected
        agent takes, 0 when it holds none of it."""
        held = {kind: 0 for s in self._d.sessions for kind in s.kinds}
        for s in self._d.sessions:
            for _token, kind in s.inflight.values():
                held[kind] = held.get(kind, 0) + 1
        return held

    def devices(self) -> list[tuple[str, Any, Any]]:
        """(agent, devices, usage) of every agent, for the GPU gauges on /metrics."""
        return [(s.id, s.protocol.ledger.devices, s.protocol.ledger.usage) for s in self._d.sessions]

    async def status(self) -> dict[str, Any]:
        """The body of ``/status``: live counts from the partial indexes, agents, limits, batching
        policies, tenants' usage and shares, unplaceable jobs, quarantined devices."""
        counts = await admin.status_counts(self.pool)
        body = counts.as_dict()
        body["agents"] = self.agents()
        body["unplaceable"] = await self.unplaceable()
        body["limits"] = await admin.limits(self.pool)
        body["batching"] = [{k: v for k, v in p.items() if k != "updated_at"} for p in await admin.batching(self.pool)]
        body["tenants"] = [t.as_dict() for t in await admin.tenants(self.pool)]  # [] while fair share is off
        body["quarantined"] = await quarantine.listing(self.pool)  # every server's agents' (gpuq device clear)
        body["agents_connected"] = self.agent_count
        body["slots"] = self.busy()
        return body
