"""The NOTIFY payload's grammar: what each notification tells a dispatcher's lease cursors."""

from gpuq.wakeups import (
    CANCEL_PREFIX,
    Wakeup,
    ids_payloads,
    kinds_payload,
    parse_cancel,
    parse_wakeup,
)


def test_inserted_kinds_carry_their_top_priority():
    assert parse_wakeup("train@0,render@5") == Wakeup({"train": 0, "render": 5})


def test_jobs_moved_back_are_behind_any_cursor():
    assert parse_wakeup("train!,render@3") == Wakeup({"train": None, "render": 3})


def test_a_kind_named_twice_keeps_the_stronger_signal():
    assert parse_wakeup("a@1,a@4") == Wakeup({"a": 4})
    assert parse_wakeup("a@4,a!") == Wakeup({"a": None})
    assert parse_wakeup("a!,a@4") == Wakeup({"a": None})


def test_a_bare_kind_or_a_star():
    assert parse_wakeup("legacy") == Wakeup({"legacy": None})  # no priority: assume behind
    assert parse_wakeup("*") == Wakeup({}, every=True, rewind=True)
    assert parse_wakeup("") == Wakeup({}, every=True, rewind=True)


def test_a_plus_is_new_jobs_of_any_kind_ahead_of_the_cursors():
    assert parse_wakeup("+") == Wakeup({}, every=True, rewind=False)


def test_a_cancel_payload_lists_its_ids_and_skips_junk():
    assert parse_cancel("cancel:41,42") == [41, 42]
    assert parse_cancel("cancel:7,x,,-3") == [7]
    assert parse_cancel("cancel:") == []


def test_built_payloads_parse_back():
    assert kinds_payload(["b", "a", "a"]) == "a,b"
    assert parse_wakeup(kinds_payload(["b", "a"], behind=True)) == Wakeup({"a": None, "b": None})
    assert kinds_payload(["k" * 100 + str(i) for i in range(100)]) == "*"  # too long for one NOTIFY
    assert parse_cancel(ids_payloads([41, 42], CANCEL_PREFIX)[0]) == [41, 42]


def test_ids_are_split_to_fit_notify():
    ids = list(range(10**18, 10**18 + 1000))
    payloads = ids_payloads(ids)
    assert all(len(p) < 8000 for p in payloads)
    assert [int(i) for p in payloads for i in p.split(",")] == ids
    assert ids_payloads([]) == []


async def test_a_plus_wakes_every_group_and_keeps_the_cursors():
    d = dispatcher({"a": (0, 50)})
    d._on_notify(None, 0, "gpuq_jobs", "+")
    assert d._notified_all and not d._rewind_all and d._cursors == {"a": (0, 50)}
    d._on_notify(None, 0, "gpuq_jobs", "*")
    assert d._rewind_all


def dispatcher(cursors=None, listening=False):
    """A dispatcher with no pool and no agents, nothing pending, and these cursors."""
    from gpuq.config import ServerConfig
    from gpuq.dispatcher import Dispatcher

    d = Dispatcher(None, ServerConfig(database_url="postgresql://unused", poll_seconds=2))
    d._notified_all = d._rewind_all = False
    d._cursors = dict(cursors or {})
    d.listening = listening
    return d


async def test_a_notification_drops_the_cursors_it_puts_jobs_behind():
    d = dispatcher()
    d._cursors = {"a": (0, 50), "b": (0, 50), "c": (5, 50), "d": (0, 9)}
    d._on_notify(None, 0, "gpuq_jobs", "a@0,b@3,c!,other@1")
    # a@0: new jobs of the cursor's priority land ahead of it; b@3: above it; c!: moved back
    assert d._cursors == {"a": (0, 50), "d": (0, 9)}
    assert {"a", "b", "c", "other"} <= d._notified


async def test_cursors_are_dropped_every_poll_while_polling_only():
    import time

    d = dispatcher({"a": (0, 50)})
    await d._lease_pass()  # nothing connected: only the bookkeeping runs
    assert d._cursors == {"a": (0, 50)}
    d._cursors_since = time.monotonic() - 3  # past poll_seconds
    await d._lease_pass()
    assert d._cursors == {}


async def test_a_listening_dispatcher_keeps_its_cursors_through_polls_for_rewind_polls():
    import time

    from gpuq.dispatcher import REWIND_POLLS

    d = dispatcher({"a": (0, 50)}, listening=True)
    d._cursors_since = time.monotonic() - 3  # past poll_seconds, not past REWIND_POLLS of them
    d.wake_all()  # a poll looks at every group: it does not rewind
    await d._lease_pass()
    assert d._cursors == {"a": (0, 50)}
    d._cursors_since = time.monotonic() - 2 * REWIND_POLLS - 1
    await d._lease_pass()
    assert d._cursors == {}


async def test_a_reconnect_or_a_star_rewinds_every_cursor():
    d = dispatcher({"a": (0, 50)}, listening=True)
    d._on_notify(None, 0, "gpuq_jobs", "*")
    await d._lease_pass()
    assert d._cursors == {}
