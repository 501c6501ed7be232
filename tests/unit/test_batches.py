"""The batch rules on their own (gpuq.batches): keys, item and cost budgets, order, partial batches."""

from hypothesis import given
from hypothesis import strategies as st

from gpuq.batches import Head, form, ready


def head(*jobs):
    """Heads from (cost, key, waited_ms) tuples, ids 1, 2, ..."""
    return [Head(i, cost, key, waited) for i, (cost, key, waited) in enumerate(jobs, 1)]


def ids(batches):
    return [[j.id for j in b.jobs] for b in batches]


def test_batches_hold_at_most_max_items_of_one_key_in_lease_order():
    jobs = head(*[(None, "a" if i % 3 else "b", 0) for i in range(7)])  # keys b a a b a a b
    got = form(jobs, max_items=2, max_cost=None)
    assert ids(got) == [[1, 4], [2, 3], [5, 6], [7]]
    assert [b.closed for b in got] == [True, True, True, False]  # the last is partial


def test_jobs_with_different_timeouts_never_share_a_batch():
    jobs = [Head(1, None, None, 0, 60), Head(2, None, None, 0, 5), Head(3, None, None, 0, 60), Head(4, None, None, 0, None)]
    assert ids(form(jobs, max_items=8, max_cost=None)) == [[1, 3], [2], [4]]


def test_costs_sum_to_at_most_max_cost_and_a_job_over_it_runs_alone():
    jobs = head((300, None, 0), (500, None, 0), (300, None, 0), (5000, None, 0), (100, None, 0))
    got = form(jobs, max_items=64, max_cost=1000)
    assert ids(got) == [[1, 2], [3], [4], [5]]
    assert [b.cost for b in got] == [800, 300, 5000, 100]
    assert [b.closed for b in got] == [True, True, True, False]  # 3 closed: the 5000 after it did not fit


def test_a_partial_batch_goes_once_its_oldest_job_waited_max_wait():
    full, old, young = form(head((None, "x", 0), (None, "x", 0), (None, "y", 12), (None, "z", 3)), 2, None)
    go, due_in = ready([full, old, young], max_wait_ms=10)
    assert go == [full, old] and due_in == 7
    assert ready([young], max_wait_ms=0) == ([young], None)


@given(st.lists(st.tuples(st.none() | st.integers(0, 50), st.sampled_from([None, "a", "b"]), st.just(0)),
                max_size=40), st.integers(1, 5), st.none() | st.integers(1, 60))
def test_every_job_is_in_exactly_one_batch_and_no_batch_breaks_a_rule(jobs, max_items, max_cost):
    got = form(head(*jobs), max_items, max_cost)
    assert sorted(i for b in got for i in (j.id for j in b.jobs)) == list(range(1, len(jobs) + 1))
    for b in got:
        assert 1 <= len(b.jobs) <= max_items and len({j.batch_key for j in b.jobs}) == 1
        assert [j.id for j in b.jobs] == sorted(j.id for j in b.jobs)
        if max_cost is not None and len(b.jobs) > 1:
            assert b.cost <= max_cost
    assert [b.jobs[0].id for b in got] == sorted(b.jobs[0].id for b in got)
