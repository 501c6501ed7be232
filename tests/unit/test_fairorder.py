"""The fair lease order's ledger (dispatcher/fairorder.py): tickets by usage per weight, lifts, drains."""

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from gpuq.dispatcher.fairorder import ESTIMATE_DEFAULT, Ledger, Tickets


def _ledger(rows, waiting) -> Ledger:
    ledger = Ledger()
    ledger.load(rows, waiting)
    return ledger


def test_tickets_follow_the_weights_and_each_ticket_advances_its_tenant():
    ledger = _ledger([("a", 3.0, 0.0, 0.0, 0.0, []), ("b", 1.0, 0.0, 0.0, 0.0, [])], [("k", "a"), ("k", "b")])
    asked = ledger.tickets(["k"], 8, probes=0)
    assert Counter(asked.names) == {"a": 6, "b": 2}


def test_the_estimate_is_each_tenant_s_mean_charge_and_running_jobs_count_at_least_it():
    ledger = _ledger([("a", 1.0, 100.0, 10.0, 0.0, [1.0, 30.0]), ("new", 1.0, 0.0, 0.0, 0.0, [])], [])
    a = ledger.tenants["a"]
    assert a.estimate == 10.0 and a.usage == 100.0 + 10.0 + 30.0 and a.running == 2
    assert ledger.tenants["new"].estimate == 10.0  # the mean of everyone's: 100 GPU-s over 10 attempts
    assert _ledger([("x", 1.0, 0.0, 0.0, 0.0, [])], []).tenants["x"].estimate == ESTIMATE_DEFAULT


def test_a_tenant_back_from_idle_is_lifted_to_the_least_busy_and_keeps_that_floor():
    ledger = _ledger([("a", 1.0, 50.0, 50.0, 0.0, [1.0]), ("c", 1.0, 0.0, 0.0, 0.0, [])], [("k", "a")])
    asked = ledger.tickets(["k"], 2, probes=4)
    assert asked.names[0] == "c" and asked.lifts == {"c": 51.0}  # a: 50 charged + 1 running job of 1
    floors = ledger.leased(["k"], asked, 2, [("k", "c", 0), ("k", "a", 1)])
    assert floors == {"c": 52.0}  # lifted to 51, plus the job it got
    assert "c" in ledger.waiting["k"]


def test_a_tenant_that_leaves_a_ticket_unfilled_is_no_longer_waiting():
    ledger = _ledger([], [("k", "a"), ("k", "b")])
    asked = Tickets(["a", "b", "a", "b"])
    ledger.leased(["k"], asked, 4, [("k", "a", 0), ("k", "b", 1), ("k", "b", 3)])  # a's second unfilled
    assert ledger.waiting["k"] == {"b"}
    ledger.leased(["k"], Tickets(["b", "b", "b"]), 2, [("k", "b", 0), ("k", "b", 1)])  # the third not reached
    assert ledger.waiting["k"] == {"b"}


def test_tenants_without_known_work_are_probed_in_turns():
    ledger = _ledger([(name, 1.0, 0.0, 0.0, 0.0, []) for name in "abcdef"], [("k", "a")])
    probed = [set(ledger.tickets(["k"], 1, probes=2).names) - {"a"} for _ in range(5)]
    assert set().union(*probed) == set("bcdef")


@given(st.lists(st.tuples(st.floats(0.1, 10), st.floats(0, 100), st.floats(0.01, 5)), min_size=1, max_size=8),
       st.integers(1, 64))
def test_tickets_go_only_to_the_least_and_never_exceed_the_slots_for_the_waiting(tenants, n):
    rows = [(f"t{i}", w, u * a, a, 0.0, []) for i, (w, u, a) in enumerate(tenants)]
    ledger = _ledger(rows, [("k", f"t{i}") for i in range(len(tenants))])
    asked = ledger.tickets(["k"], n, probes=0)
    assert len(asked.names) == n
    # Stride: at the end no tenant's next ticket would have come before one already given.
    ends = Counter(asked.names)
    for name, t in ledger.tenants.items():
        given_vt = t.vt + (ends[name] - 1) * t.estimate / t.weight if ends[name] else None
        for other, o in ledger.tenants.items():
            next_vt = o.vt + ends[other] * o.estimate / o.weight
            if given_vt is not None and other != name:
                assert given_vt <= next_vt + 1e-9


def test_jobs_that_charge_nothing_still_take_turns_by_weight():
    """Usage 0 over many attempts: without a floor on the estimate, 'a' would take every ticket."""
    ledger = _ledger([("a", 1.0, 0.0, 50.0, 0.0, []), ("b", 1.0, 0.0, 50.0, 0.0, [])], [("k", "a"), ("k", "b")])
    assert Counter(ledger.tickets(["k"], 10, probes=0).names) == {"a": 5, "b": 5}


def test_a_floor_never_lifts_a_tenant_above_the_least_busy_one():
    """c was lifted to 10 GPU-s when a's jobs were thought to take 1 s; they take 0.2: a's usage
    is 2. c counts as having used 2, not 10, so it is not held back while a catches up."""
    ledger = _ledger([("a", 1.0, 1.0, 5.0, 0.0, [0.1]), ("c", 1.0, 0.0, 1.0, 10.0, [])], [("k", "a"), ("k", "c")])
    assert ledger.tenants["c"].floor == 1.2  # a: 1 charged + 1 running job of 0.2 expected
    assert Counter(ledger.tickets(["k"], 2, probes=0).names) == {"a": 1, "c": 1}  # level, not held back
