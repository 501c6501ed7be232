"""The census's pace (gpuq.census): its period, stretched by a slow read to keep its share of the time."""

import pytest

from gpuq.census import LOAD_SHARE, Census
from gpuq.config import ConfigError, ServerConfig


def test_a_slow_read_stretches_the_period_to_its_load_share():
    c = Census(pool=None, period=5.0)
    assert c.interval() == 5.0
    c.took = 0.027  # 100,000 pending jobs
    assert c.interval() == 5.0
    c.took = 0.5  # a read of 0.5 s: the next one LOAD_SHARE of the time later
    assert c.interval() == pytest.approx(0.5 / LOAD_SHARE)


@pytest.mark.parametrize("name", ["metrics_sample_seconds", "ui_sample_seconds"])
def test_a_sample_period_must_be_positive(name):
    with pytest.raises(ConfigError, match=name):
        ServerConfig(database_url="x", **{name: 0})
