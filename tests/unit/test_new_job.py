"""``NewJob.from_mapping``: loose fields (flags, JSON lines, keyword arguments) to a job, or one readable error."""

from datetime import UTC, datetime

import pytest

from gpuq.jobs import NewJob


def test_only_a_kind_takes_every_default():
    assert NewJob.from_mapping({"kind": "embed"}) == NewJob("embed")


def test_every_field_by_its_own_name():
    at = datetime(2030, 1, 1, tzinfo=UTC)
    job = NewJob.from_mapping({
        "kind": "train", "payload": {"steps": 3}, "priority": 5, "max_attempts": 2, "delay_seconds": 1.5,
        "run_at": at, "dedup_key": "d", "timeout_seconds": 60, "gpus": 2, "gpu_memory_mb": 40_000,
        "labels": ["gpu=h100"], "model": "llama-3", "concurrency_key": "tenant-a"})
    assert job == NewJob("train", {"steps": 3}, 5, 2, 1.5, at, "d", 60, 2, 40_000, ("gpu=h100",), "llama-3",
                         "tenant-a")
    assert job.placed


def test_the_cli_names_of_delay_and_timeout():
    job = NewJob.from_mapping({"kind": "k", "delay": 2, "timeout": 30})
    assert (job.delay_seconds, job.timeout_seconds) == (2, 30)


def test_nulls_where_a_field_may_be_unset():
    job = NewJob.from_mapping({"kind": "k", "payload": None, "timeout": None, "gpu_memory_mb": None, "model": None,
                               "dedup_key": None, "concurrency_key": None, "run_at": None})
    assert job == NewJob("k")


@pytest.mark.parametrize("given, error", [
    ("not a mapping", 'expected an object with a "kind"'),
    ([["kind", "k"]], 'expected an object with a "kind"'),
    ({"payload": {}}, 'expected an object with a "kind"'),
    ({"kind": "k", "colour": "red", "size": 1}, "unknown field(s) colour, size"),
    ({"kind": "k", "timeout": 5, "timeout_seconds": 5}, "timeout_seconds given twice"),
    ({"kind": None}, "kind must be a string"),
    ({"kind": "a,b"}, "bad job kind"),
    ({"kind": "k", "priority": "high"}, "priority must be a whole number"),
    ({"kind": "k", "priority": 1.5}, "priority must be a whole number"),
    ({"kind": "k", "priority": True}, "priority must be a whole number"),
    ({"kind": "k", "priority": None}, "priority must be a whole number"),
    ({"kind": "k", "priority": 40_000}, "out of range"),
    ({"kind": "k", "max_attempts": 0}, "max_attempts must be at least 1"),
    ({"kind": "k", "delay": "soon"}, "delay must be a number of seconds"),
    ({"kind": "k", "delay": -1}, "delay must not be negative"),
    ({"kind": "k", "run_at": "2030-01-01"}, "run_at must be a datetime"),
    ({"kind": "k", "timeout": 0}, "timeout must be at least 1 second"),
    ({"kind": "k", "timeout": "1h"}, "timeout_seconds must be a whole number"),
    ({"kind": "k", "gpus": 65}, "gpus must be 0-64"),
    ({"kind": "k", "gpu_memory_mb": 1000}, "needs gpus of at least 1"),
    ({"kind": "k", "labels": "gpu=h100"}, "labels must be a list of labels"),
    ({"kind": "k", "labels": [1, 2]}, "labels must be a list of labels"),
    ({"kind": "k", "labels": ["no spaces allowed"]}, "labels must be at most 16 of"),
    ({"kind": "k", "model": 7}, "model must be a string"),
    ({"kind": "k", "concurrency_key": ""}, "concurrency_key must be 1-256 characters"),
])
def test_bad_input_is_one_readable_value_error(given, error):
    with pytest.raises(ValueError) as caught:
        NewJob.from_mapping(given)
    assert error in str(caught.value)


@pytest.mark.parametrize(("fields", "says"), [
    ({"cost": -1}, "cost must be a whole number"),
    ({"cost": 2**63}, "cost must be a whole number"),
    ({"cost": 1.5}, "cost must be a whole number, not 1.5"),
    ({"batch_key": ""}, "batch_key must be 1-200 characters"),
    ({"batch_key": "x" * 201}, "batch_key must be 1-200 characters"),
    ({"batch_key": 3}, "batch_key must be a string"),
])
def test_a_bad_batching_field_is_a_clear_error(fields, says):
    with pytest.raises(ValueError, match=says):
        NewJob.from_mapping({"kind": "embed", **fields})


def test_batching_fields_are_optional_and_kept():
    job = NewJob.from_mapping({"kind": "embed", "cost": 512, "batch_key": "len-128"})
    assert (job.cost, job.batch_key, job.placed) == (512, "len-128", False)
    assert (NewJob("embed").cost, NewJob("embed").batch_key) == (None, None)
