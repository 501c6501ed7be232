"""The overview's last hour: rates from the counters, latency from what was leased and finished."""

from types import SimpleNamespace

from gpuq import metrics
from gpuq.jobs import StatusCounts
from gpuq.latency import JobLatency, percentiles
from gpuq.ui.trend import HEIGHT, WIDTH, Trend, chart


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _counts(pending: int, leased: int) -> StatusCounts:
    return StatusCounts({"pending": {"a": pending}, "leased": {"a": leased}, "scheduled": {}}, None, 0)


def test_a_sample_holds_the_rates_since_the_last_and_the_depth_now():
    wall, mono = Clock(), Clock()
    latency = JobLatency(clock=mono)
    trend = Trend(latency, 10.0, clock=wall)
    latency.leased([SimpleNamespace(id=1, queued_ms=40), SimpleNamespace(id=2, queued_ms=60),
                    SimpleNamespace(id=3, queued_ms=None)])
    mono.now += 0.5
    latency.finished([1, 3], other=[2])
    metrics.JOBS_DONE.labels(kind="trend-test").inc(50)
    metrics.JOBS_FAILED.labels(kind="trend-test", outcome="dead").inc(10)
    metrics.JOBS_FAILED.labels(kind="trend-test", outcome="scheduled").inc(99)  # failed, retried: not dead
    wall.now += 10
    s = trend.take(_counts(7, 3))
    assert (s.done_per_s, s.failed_per_s, s.dead_per_s, s.pending, s.leased) == (5.0, 10.9, 1.0, 7, 3)
    assert (s.lease_p50_ms, round(s.completion_p50_ms, 6)) == (60, 540.0)  # job 1: due 40 ms before, done 500 ms after
    wall.now += 10
    s = trend.take(_counts(0, 0))
    assert (s.done_per_s, s.lease_p50_ms, s.completion_p50_ms) == (0.0, None, None)  # each take starts afresh
    charts = trend.charts()
    assert charts["samples"] == 2 and charts["depth"]["top"] == 7 and charts["span_seconds"] == 10
    assert charts["last"]["pending"] == 0 and charts["last"]["lease_p50"] == 60  # the last sample that had one


def test_the_ring_holds_one_hour():
    trend = Trend(JobLatency(), 60.0)
    for _ in range(100):
        trend.take(_counts(1, 0))
    assert len(trend.samples) == 60


def test_a_chart_puts_the_newest_at_the_right_edge_and_skips_gaps():
    points = chart([0.0, None, 5.0], top=10.0, slots=3).split()
    assert points == [f"0.0,{HEIGHT:.1f}", f"{WIDTH:.1f},{HEIGHT / 2:.1f}"]


def test_percentiles():
    assert percentiles([]).n == 0
    p = percentiles([float(i) for i in range(1, 101)])
    assert (p.n, p.p50_ms, p.p99_ms) == (100, 51.0, 100.0)


def test_latency_forgets_everything_beyond_its_cap(monkeypatch):
    from gpuq import latency as module

    monkeypatch.setattr(module, "FOLLOWED", 3)
    monkeypatch.setattr(module, "FOLLOW_EVERY", 1)
    lat = JobLatency()
    lat.leased([SimpleNamespace(id=i, queued_ms=1) for i in range(5)])
    lat.leased([SimpleNamespace(id=9, queued_ms=1)])  # over the cap: the unfinished ones are dropped
    assert list(lat._due) == [9]


def test_latency_figures_stay_bounded_when_nobody_takes_them(monkeypatch):
    from gpuq import latency as module

    monkeypatch.setattr(module, "KEPT", 100)
    lat = JobLatency()
    for start in range(0, 5000, 64):  # batches, as the dispatcher leases them
        lat.leased([SimpleNamespace(id=i, queued_ms=i % 10) for i in range(start, min(start + 64, 5000))])
    assert 100 <= len(lat._lease_ms.values) < 200  # an even sample, not every figure
    lease, _ = lat.take()
    assert lease.n == 5000 and 0 <= lease.p50_ms <= 9


def test_one_job_in_a_few_of_a_batch_is_followed_and_off_means_nothing_kept():
    lat = JobLatency()
    lat.leased([SimpleNamespace(id=i, queued_ms=5) for i in range(8)])
    assert sorted(lat._due) == [0, 4]  # every wait counts, every fourth job is followed
    lat.leased([SimpleNamespace(id=9, queued_ms=5)])
    assert 9 in lat._due  # a batch of one (idle agents): always followed
    lat.finished({0, 1, 9}, other={4})
    lease, completion = lat.take()
    assert (lease.n, completion.n, lat._due) == (9, 2, {})
    off = JobLatency(enabled=False)
    off.leased([SimpleNamespace(id=1, queued_ms=5)])
    off.finished({1})
    assert off.take()[0].n == 0 and off._due == {}


def test_a_sample_is_every_strideth_value_across_batches(monkeypatch):
    from gpuq import latency as module

    monkeypatch.setattr(module, "KEPT", 4)
    sample = module.Sample()
    for batch in ([0, 1, 2], [3, 4, 5, 6, 7, 8], [9, 10, 11]):
        sample.add([float(v) for v in batch])
    assert sample.seen == 12 and sample.stride == 2
    assert sample.values == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]  # even across batch edges
