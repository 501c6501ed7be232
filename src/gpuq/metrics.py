"""Prometheus metrics, one registry for the process (served at /metrics)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from gpuq.backlog import COUNT_CAP, Backlog
from gpuq.jobs import LIVE_STATES, StatusCounts
from gpuq.protocol.slots import GAP_BUCKETS_MS, SlotReport
from gpuq.tenants import Tenant

REGISTRY = CollectorRegistry(auto_describe=True)

JOBS_LEASED = Counter("gpuq_jobs_leased", "Jobs leased to agents", ["kind"], registry=REGISTRY)
JOBS_DONE = Counter("gpuq_jobs_completed", "Completions committed", ["kind"], registry=REGISTRY)
JOBS_FAILED = Counter("gpuq_jobs_failed", "Failures committed, by outcome (scheduled = will retry)",
                      ["kind", "outcome"], registry=REGISTRY)
RESULTS_REJECTED = Counter(
    "gpuq_results_rejected", "Results refused by lease fencing (stale token)", registry=REGISTRY
)
LEASE_SECONDS = Histogram(
    "gpuq_lease_query_seconds", "Duration of one lease statement (both phases)",
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1.0), registry=REGISTRY,
)
BATCH_SIZE = Histogram(
    "gpuq_batch_size", "Jobs in each batch leased for one handler call (batched kinds)", ["kind"],
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096), registry=REGISTRY)
BATCH_FORMING_SECONDS = Histogram(
    "gpuq_batch_forming_seconds", "How long each batched job had been due when its batch was leased", ["kind"],
    buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 60), registry=REGISTRY)
LEASE_BATCH = Histogram(
    "gpuq_lease_batch_size", "Jobs leased per lease statement",
    buckets=(0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024), registry=REGISTRY,
)
AGENTS = Gauge("gpuq_agents_connected", "Agents connected to this dispatcher", registry=REGISTRY)
INFLIGHT = Gauge("gpuq_jobs_inflight", "Jobs pushed to agents of this dispatcher, not yet reported",
                 registry=REGISTRY)
INFLIGHT_BY_KIND = Gauge("gpuq_jobs_inflight_by_kind", "Jobs pushed to agents of this dispatcher, not yet "
                         "reported, per kind (at scrape time; every kind a connected agent takes)", ["kind"],
                         registry=REGISTRY)
QUEUE_DEPTH = Gauge("gpuq_queue_depth", "Live jobs by state (from the partial indexes, as the census last read "
                    "them: gpuq_queue_sample_age_seconds ago)", ["status"], registry=REGISTRY)
QUEUE_SAMPLE_AGE = Gauge("gpuq_queue_sample_age_seconds", "How old the gauges read from the database are (queue "
                         "depth, paused kinds, backlog, tenants): seconds since the census's last successful read "
                         "began (NaN before the first)", registry=REGISTRY)
QUEUE_SAMPLE_AGE.set(float("nan"))
PAUSED = Gauge("gpuq_kind_paused", "1 for each paused kind: its pending jobs are not leased (autoscalers "
               "leave them out: unless on (kind) gpuq_kind_paused)", ["kind"], registry=REGISTRY)
SWEEP_RECLAIMED = Counter("gpuq_jobs_reclaimed", "Expired leases returned to pending by the sweeper",
                          registry=REGISTRY)
SWEEP_DEAD = Counter("gpuq_sweeper_dead", "Expired leases with no attempts left, now dead", registry=REGISTRY)
SWEEP_PROMOTED = Counter("gpuq_sweeper_promoted", "Scheduled jobs promoted to pending", registry=REGISTRY)
SWEEP_PRUNED = Counter("gpuq_sweeper_pruned", "Done/dead rows deleted by retention", registry=REGISTRY)
NOTIFICATIONS = Counter("gpuq_notifications", "NOTIFY messages received", registry=REGISTRY)
WAKEUP_ARMS = Counter("gpuq_wakeup_arms", "Times the dispatcher asked producers to NOTIFY; lapsed=true: "
                      "after the mark had lapsed, so it saw the stragglers end and leased once more",
                      ["lapsed"], registry=REGISTRY)
PROTOCOL_ERRORS = Counter("gpuq_protocol_errors", "Agent messages refused", ["code"], registry=REGISTRY)
PROGRESS_WRITTEN = Counter("gpuq_progress_written", "Progress updates stored (at most one per job per second)",
                           registry=REGISTRY)
CHECKPOINTS_WRITTEN = Counter("gpuq_checkpoints_written", "Checkpoints stored (job.checkpoint(), fenced by the lease)",
                              registry=REGISTRY)
DEVICE_MEMORY_TOTAL = Gauge("gpuq_agent_device_memory_total_bytes", "A connected agent's GPU memory",
                            ["agent", "device", "name"], registry=REGISTRY)
DEVICE_MEMORY_USED = Gauge("gpuq_agent_device_memory_used_bytes", "GPU memory in use (NVML, at its last heartbeat)",
                           ["agent", "device"], registry=REGISTRY)
DEVICE_UTILIZATION = Gauge("gpuq_agent_device_utilization_ratio", "GPU utilisation 0-1 (NVML, at its last heartbeat)",
                           ["agent", "device"], registry=REGISTRY)

TENANT_USAGE = Gauge("gpuq_tenant_usage_gpu_seconds", "A tenant's usage: GPU-seconds (1 slot for a CPU job) decayed "
                     "with the half-life, with its running jobs' so far (while fair share is on)", ["tenant"],
                     registry=REGISTRY)
TENANT_SHARE = Gauge("gpuq_tenant_share", "A tenant's part of every listed tenant's usage, 0-1 (while fair share "
                     "is on)", ["tenant"], registry=REGISTRY)
TENANT_FAIR_SHARE = Gauge("gpuq_tenant_fair_share", "The part a tenant's weight entitles it to among the tenants "
                          "with work or usage, 0-1 (while fair share is on)", ["tenant"], registry=REGISTRY)
TENANT_WEIGHT = Gauge("gpuq_tenant_weight", "A tenant's weight (1 unless set; while fair share is on)", ["tenant"],
                      registry=REGISTRY)
TENANT_BACKLOG = Gauge("gpuq_tenant_backlog", f"A tenant's pending jobs, counted up to {COUNT_CAP} (while fair share "
                       "is on)", ["tenant"], registry=REGISTRY)
_TENANT_GAUGES = (TENANT_USAGE, TENANT_SHARE, TENANT_FAIR_SHARE, TENANT_WEIGHT, TENANT_BACKLOG)


def show_tenants(tenants: Iterable[Tenant]) -> None:
    """Set the tenant gauges from the census's read (``gpuq.census``): a series for each tenant it
    listed (none while fair share is off)."""
    for gauge in _TENANT_GAUGES:
        gauge.clear()
    for t in tenants:
        for gauge, value in zip(_TENANT_GAUGES, (t.usage, t.share, t.fair_share, t.weight, t.pending), strict=True):
            gauge.labels(tenant=t.name).set(value)


def show_devices(agents: Iterable[tuple[str, Iterable[Any], dict[int, Any]]]) -> None:
    """Set the device gauges, at scrape time, from ``(agent id, devices, usage by index)`` of the
    agents connected now: an agent that left leaves no stale series."""
    for gauge in (DEVICE_MEMORY_TOTAL, DEVICE_MEMORY_USED, DEVICE_UTILIZATION):
        gauge.clear()
    for agent, devices, usage in agents:
        for d in devices:
            index = str(d.index)
            DEVICE_MEMORY_TOTAL.labels(agent=agent, device=index, name=d.name).set(d.memory_mb << 20)
            if (u := usage.get(d.index)) is not None:
                DEVICE_MEMORY_USED.labels(agent=agent, device=index).set(u.memory_used_mb << 20)
                DEVICE_UTILIZATION.labels(agent=agent, device=index).set(u.utilization / 100)


def show_queue(counts: StatusCounts, backlog: Iterable[Backlog], tenants: Iterable[Tenant],
               age: Callable[[], float]) -> None:
    """Set the gauges read from the database (``gpuq.census``): queue depth, paused kinds, the
    backlog per kind and shape, the tenants (none while fair share is off), and ``age``, how old
    they are at each scrape."""
    for status in LIVE_STATES:
        QUEUE_DEPTH.labels(status=status).set(counts.total(status))
    show_paused(counts.paused)
    BACKLOG.show(backlog)
    show_tenants(tenants)
    QUEUE_SAMPLE_AGE.set_function(age)


def show_paused(kinds: Iterable[str]) -> None:
    """Set ``gpuq_kind_paused``: a series for each kind paused now, none for the others."""
    PAUSED.clear()
    for kind in kinds:
        PAUSED.labels(kind=kind).set(1)


def show_inflight(by_kind: dict[str, int]) -> None:
    """Set ``gpuq_jobs_inflight_by_kind``, at scrape time, from the agents connected now."""
    INFLIGHT_BY_KIND.clear()
    for kind, n in by_kind.items():
        INFLIGHT_BY_KIND.labels(kind=kind).set(n)


class SlotGaps:
    """``gpuq_slot_gap_seconds``: the idle gaps agents report (protocol 6), a histogram built from
    their per-bucket counts (prometheus_client's Histogram only observes single values); and
    ``gpuq_slot_busy_seconds_total``, their handler time. Busy fraction over a range:
    busy / (busy + gap sum)."""

    def __init__(self) -> None:
        self._counts = [0] * (len(GAP_BUCKETS_MS) + 1)
        self._gap_seconds = 0.0
        self._busy_seconds = 0.0

    def add(self, report: SlotReport) -> None:
        for i, n in enumerate(report.gaps):
            self._counts[i] += n
        self._gap_seconds += report.idle_ms / 1000
        self._busy_seconds += report.busy_ms / 1000

    def collect(self) -> Iterable[Any]:
        cumulative, buckets = 0, []
        for bound, n in zip((*GAP_BUCKETS_MS, float("inf")), self._counts, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound / 1000), cumulative))
        yield HistogramMetricFamily("gpuq_slot_gap_seconds", "Idle gaps of agents' slots between one job and "
                                    "the next while it waited (reported by protocol 6 agents)",
                                    buckets=buckets, sum_value=self._gap_seconds)
        yield CounterMetricFamily("gpuq_slot_busy_seconds", "Handler time reported by protocol 6 agents",
                                  value=self._busy_seconds)


SLOT_GAPS = SlotGaps()
REGISTRY.register(SLOT_GAPS)  # type: ignore[arg-type]


BACKLOG_LABELS = ("kind", "shape", "gpus", "gpu_memory_mb", "labels", "model")


class BacklogGauges:
    """``gpuq_pending_jobs`` and ``gpuq_pending_oldest_seconds`` per kind and placement shape, as
    the census last read them (``gpuq.backlog``, ``gpuq.census``). A series once shown stays, at 0, when its
    backlog is gone: autoscalers see zero, not an absent series. One series per kind with plain
    jobs (shape "") and per row of gpuq.shapes: as many as the shapes the dispatchers know."""

    def __init__(self) -> None:
        self._latest: dict[tuple[str, ...], tuple[int, float]] = {}

    def show(self, backlog: Iterable[Backlog]) -> None:
        latest = {key: (0, 0.0) for key in self._latest}
        for b in backlog:
            latest[backlog_labels(b)] = (b.pending, b.oldest_seconds or 0.0)
        self._latest = latest

    def collect(self) -> Iterable[Any]:
        pending = GaugeMetricFamily(
            "gpuq_pending_jobs", f"Pending jobs per kind and placement shape, counted up to {COUNT_CAP} (at the cap: "
            "at least that many); shape \"\" is the kind's plain jobs", labels=BACKLOG_LABELS)
        oldest = GaugeMetricFamily(
            "gpuq_pending_oldest_seconds", "How long the next job of a kind and shape has been due (the longest "
            "over its priority levels; 0 when none is pending)", labels=BACKLOG_LABELS)
        for key, (n, seconds) in sorted(self._latest.items()):
            pending.add_metric(key, n)
            oldest.add_metric(key, seconds)
        yield pending
        yield oldest


def backlog_labels(b: Backlog) -> tuple[str, ...]:
    """The label values of one kind and shape: NULL requirements as "", labels comma-joined."""
    s = b.shape
    return (s.kind, s.digest, str(s.gpus), "" if s.gpu_memory_mb is None else str(s.gpu_memory_mb),
            ",".join(sorted(s.labels)), s.model or "")


BACKLOG = BacklogGauges()
REGISTRY.register(BACKLOG)  # type: ignore[arg-type]
