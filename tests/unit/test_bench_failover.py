"""bench failover's verdict, pure: the ledger against the new primary's rows, and the thresholds of #29."""

import json

from gpuq.bench.failover import failures_of, judge
from gpuq.bench.handlers import failover_answer


def _row(payload, status="done", result=None, attempts=1):
    result = failover_answer(payload) if result is None and status == "done" else result
    return {"payload": json.dumps(payload), "status": status, "attempts": attempts,
            "result": None if result is None else json.dumps(result)}


def test_the_ledger_is_judged_by_the_rows_never_by_the_acks():
    ledger = {1: {"n": 1, "x": 10}, 2: {"n": 2, "x": 20}, 3: {"n": 3, "x": 30}, 4: {"n": 4, "x": 40}}
    rows = {
        1: _row(ledger[1]),
        # 2: acked, then gone with the old primary
        3: _row({"n": 9, "x": 99}),  # the id handed out again, to another job (asynchronous replication)
        4: _row(ledger[4], status="pending"),
        5: _row({"n": 5, "x": 50}, result={"n": 5, "digest": "not it"}, attempts=2),  # not in the ledger: wrong
    }
    assert judge(ledger, rows) == {"lost": 1, "id_mismatch": 1, "not_done": 1, "wrong": 1, "done": 3, "retried": 1}


def test_only_the_must_pass_variants_are_judged():
    clean = {"lost": 0, "id_mismatch": 0, "not_done": 0, "wrong": 0, "serve_exits": 0, "agent_exits": 0,
             "waiters_failed": 0, "reexecuted": 2, "inflight_at_kill": 3, "recovery_s": 0.4}
    assert failures_of("sync", clean) == []
    assert failures_of("sync", {**clean, "recovery_s": None}) == ["sync.recovery_s=None"]
    assert failures_of("readonly", {**clean, "recovery_s": 10.5}) == ["readonly.recovery_s=10.5"]
    assert failures_of("blackhole", {**clean, "reexecuted": 4}) == ["blackhole.reexecuted=4>inflight_at_kill=3"]
    assert failures_of("sync", {**clean, "lost": 1, "waiters_failed": 2}) == ["sync.lost=1", "sync.waiters_failed=2"]
    assert failures_of("async", {**clean, "lost": 5, "recovery_s": None}) == []
