"""The NOTIFY payload's grammar: what each notification tells a dispatcher's lease cursors."""

from gpuq.config import ServerConfig
from gpuq.dispatcher.cursors import Cursors
from gpuq.dispatcher.trigger import LeaseTrigger, Pass
from gpuq.dispatcher.tuning import Tuning
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


def trigger(cursors: Cursors | None = None, cancelled: list[int] | None = None) -> LeaseTrigger:
    """A dispatcher's lease trigger with no pool, whose announced kinds move ``cursors``."""
    cursors = cursors or Cursors(0.0)
    w = LeaseTrigger(None, ServerConfig(database_url="postgresql://unused", poll_seconds=2), Tuning(),
                on_kind=cursors.announced, on_cancel=(cancelled if cancelled is not None else []).extend)
    w.take()  # the first pass's "everything"
    return w


async def test_a_plus_wakes_every_group_and_keeps_the_cursors():
    c = Cursors(0.0)
    c.cursors = {"a": (0, 50)}
    w = trigger(c)
    w.on_notify(None, 0, "gpuq_jobs", "+")
    why = await w.wait(any_room=True, placing_wait=lambda: None)
    assert why is not None and why.every and not why.rewind and c.cursors == {"a": (0, 50)}
    w.on_notify(None, 0, "gpuq_jobs", "*")
    assert w.take().rewind


async def test_a_notification_drops_the_cursors_it_puts_jobs_behind():
    c = Cursors(0.0)
    c.cursors = {"a": (0, 50), "b": (0, 50), "c": (5, 50), "d": (0, 9)}
    w = trigger(c)
    w.on_notify(None, 0, "gpuq_jobs", "a@0,b@3,c!,other@1")
    # a@0: new jobs of the cursor's priority land ahead of it; b@3: above it; c!: moved back
    assert c.cursors == {"a": (0, 50), "d": (0, 9)}
    why = w.take()
    assert why.kinds == {"a", "b", "c", "other"} and not why.every


async def test_a_cancel_goes_to_the_agents_and_wakes_no_pass():
    cancelled: list[int] = []
    w = trigger(cancelled=cancelled)
    w.on_notify(None, 0, "gpuq_jobs", CANCEL_PREFIX + "7,9")
    assert cancelled == [7, 9]
    assert w.take() == Pass()


async def test_reasons_gathered_between_passes_are_taken_once():
    w = trigger()
    w.credit_freed(frozenset({"a"}))
    w.recheck({"b"})
    why = await w.wait(any_room=True, placing_wait=lambda: None)
    assert why == Pass(kinds={"b"}, credit={frozenset({"a"})})
    assert w.take() == Pass()


async def test_with_no_room_and_nothing_announced_a_wait_waits():
    import anyio

    w = trigger()
    with anyio.move_on_after(0.05) as scope:
        await w.wait(any_room=False, placing_wait=lambda: None)
    assert scope.cancelled_caught  # no mark to arm, no poll: only freed credit wakes it


async def test_a_pass_placement_asks_for_runs_without_a_wake_up():
    w = trigger()
    w.listening = True  # and the last poll just now: no poll is due
    why = await w.wait(any_room=False, placing_wait=lambda: 0.0)
    assert why is not None and not why.every and not why.polled


async def test_a_failed_pass_gives_its_reasons_back_to_the_next():
    w = trigger()
    w.on_notify(None, 0, "gpuq_jobs", "*")
    w.on_notify(None, 0, "gpuq_jobs", "a@1")
    w.credit_freed(frozenset({"b"}))
    why = w.take()
    w.put_back(why)  # the pass raised before it could use them
    again = w.take()
    assert again.rewind and again.every and again.kinds == {"a"} and again.credit == {frozenset({"b"})}
