"""A dashboard request's parameters, checked before any query runs."""

import pytest

from gpuq.jobs import JobFilter, RetryFilter
from gpuq.ui import params


def test_a_query_string_reads_as_one_value_per_name():
    assert params.parse("/ui/jobs?kind=a&kind=b&state=dead&empty=") == {"kind": "b", "state": "dead"}


def test_job_filters_and_their_round_trip_to_a_query_string():
    which = params.job_filter({"kind": "train", "state": "failed", "key": " tenant-3 ", "error": "OOM"})
    assert which == JobFilter(kind="train", state="failed", key="tenant-3", error="OOM")
    assert params.job_filter(params.parse("/ui/jobs?" + params.filter_query(which))) == which
    assert params.job_filter({}) == JobFilter()


@pytest.mark.parametrize("query, says", [
    ({"kind": "a b"}, "bad job kind"), ({"state": "running"}, "state must be one of"),
    ({"error": "x" * 201}, "too long"), ({"before": "-1"}, "bad job id"),
])
def test_bad_filters_say_what_is_wrong(query, says):
    with pytest.raises(ValueError, match=says):
        params.job_filter(query)
        params.before(query)


def test_ids_and_whole_numbers():
    assert params.job_id("42") == 42
    for bad in ("0", "x", "9" * 30, ""):
        with pytest.raises(ValueError, match="bad job id"):
            params.job_id(bad)
    assert params.whole({"max": " 3 "}, "max") == 3 and params.whole({"max": ""}, "max") is None
    with pytest.raises(ValueError, match="max must be a whole number"):
        params.whole({"max": "3.5"}, "max")


def test_retry_takes_one_id_or_a_failed_lists_filters():
    assert params.retry_filter({"id": "7", "kind": "ignored"}) == RetryFilter(ids=[7])
    assert params.retry_filter({"state": "failed", "kind": "train"}) == RetryFilter(kind="train")
    assert params.retry_filter({"state": "dead", "error": "OOM"}) == RetryFilter(error="OOM", state="dead")
    with pytest.raises(ValueError, match="dead, cancelled or failed"):
        params.retry_filter({"state": "pending", "kind": "train"})


def test_a_list_shows_an_errors_last_line():
    from gpuq.jobs import error_line

    assert error_line("Traceback (most recent call last):\n  File x\nRuntimeError: CUDA out of memory\n") == \
        "RuntimeError: CUDA out of memory"
    assert error_line(None) == error_line("  \n") == ""
