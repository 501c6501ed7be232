"""preemption.py: which running preemptible jobs a blocked higher-priority job may ask to yield."""

from gpuq.preemption import Blocked, Box, Choice, Held, choose, eligible_in

URGENT = Blocked(priority=10, gpus=1)


def run(id, devices, priority=0, ran=100.0, preemptible=True, yielding=False):
    return Held(id, tuple(devices), True, preemptible, priority, ran, yielding)


def ready(id, devices, priority=0, preemptible=True):
    return Held(id, tuple(devices), False, preemptible, priority, 0.0)


def test_the_lowest_priority_victim_that_frees_a_device_is_chosen():
    box = Box("a", (0, 1), (run(1, [0], priority=5), run(2, [1], priority=1)))
    assert choose(URGENT, [box], 60) == Choice("a", (2,))


def test_never_a_job_of_equal_or_higher_priority_nor_one_not_preemptible_nor_one_too_young():
    for held in (run(1, [0], priority=10), run(1, [0], preemptible=False), run(1, [0], ran=5.0)):
        assert choose(URGENT, [Box("a", (0,), (held,))], 60) is None
    assert eligible_in([run(1, [0], ran=5.0)], URGENT, 60) == 55.0  # when to look again


def test_never_more_victims_than_needed_and_a_multi_gpu_victim_counts_once():
    two = Blocked(priority=10, gpus=2)
    box = Box("a", (0, 1, 2), (run(1, [0]), run(2, [1]), run(3, [2]), ))
    assert len(choose(two, [box], 0).victims) == 2
    wide = Box("b", (0, 1), (run(7, [0, 1], priority=3),))
    assert choose(two, [box, wide], 0) == Choice("b", (7,))  # one victim beats two


def test_a_free_device_counts_and_only_the_agent_with_the_fewest_victims_is_asked():
    a = Box("a", (0, 1), (run(1, [0]),))  # device 1 free: one victim frees a second
    b = Box("b", (0, 1), (run(2, [0]), run(3, [1])))
    assert choose(Blocked(10, 2), [b, a], 0) == Choice("a", (1,))


def test_no_victim_while_earlier_ones_are_yielding_and_room_asks_nothing():
    assert choose(URGENT, [Box("a", (0,), (run(1, [0], yielding=True),))], 0) == Choice("a", waiting=True)
    assert choose(URGENT, [Box("a", (0, 1), (run(1, [0]),))], 0) == Choice("a")


def test_a_ready_job_on_the_freed_device_is_given_back_and_a_non_preemptible_one_blocks_it():
    box = Box("a", (0,), (run(1, [0]), ready(2, [0])))
    assert choose(URGENT, [box], 0) == Choice("a", (1,), (2,))
    blocked = Box("a", (0,), (run(1, [0]), ready(2, [0], preemptible=False)))
    assert choose(URGENT, [blocked], 0) is None


def test_a_plain_job_on_full_agents_asks_one_lowest_priority_victim_for_a_slot():
    plain = Blocked(10, 0)
    full = Box("a", (), (run(1, [], priority=5), run(2, [], priority=1), run(3, [0], priority=0)))
    assert choose(plain, [full], 0) == Choice("a", (2,))  # one victim, the lowest priority without devices
    assert choose(plain, [full, Box("b", (), (), slots=1)], 0) == Choice("b")  # room elsewhere: none asked
    assert choose(plain, [Box("a", (), (run(1, []), ready(2, [])))], 0) == Choice("a", released=(2,))


def test_a_plain_job_never_preempts_equal_or_higher_priority_nor_again_while_one_yields():
    plain = Blocked(10, 0)
    for held in (run(1, [], priority=10), run(1, [], priority=11), run(1, [], preemptible=False),
                 run(1, [], ran=5.0)):
        assert choose(plain, [Box("a", (), (held,))], 60) is None
    asked = Box("a", (), (run(1, [], yielding=True), run(2, [])))
    assert choose(plain, [asked], 0) == Choice("a", waiting=True)  # its slot is freed already


def test_a_job_waiting_ready_on_busy_devices_preempts_what_runs_there_under_the_same_rules():
    from gpuq.preemption import for_ready

    urgent_ready = Held(9, (0,), False, False, 10, 0.0)
    assert for_ready(Box("a", (0, 1), (run(1, [0]), run(2, [1]), urgent_ready)), 60) == [1]
    assert for_ready(Box("a", (0,), (run(1, [0], priority=10), urgent_ready)), 60) == []  # not lower
    assert for_ready(Box("a", (0,), (run(1, [0], ran=1.0), urgent_ready)), 60) == []  # too young
    assert for_ready(Box("a", (0,), (run(1, [0], yielding=True), urgent_ready)), 60) == []  # asked already
    low_ready = Held(8, (0,), False, True, 0, 0.0)
    assert for_ready(Box("a", (0,), (run(1, [0]), low_ready)), 60) == []  # of no higher priority


def test_a_plain_job_held_ready_behind_a_lower_priority_running_one_asks_it_to_yield():
    from gpuq.preemption import for_ready_slot

    urgent_ready = Held(9, (), False, False, 10, 0.0)
    assert for_ready_slot(Box("a", (), (run(1, [], priority=1), urgent_ready)), 0) == Choice("a", (1,))
    assert for_ready_slot(Box("a", (), (run(1, [], priority=10), urgent_ready)), 0) is None  # equal: never
    assert for_ready_slot(Box("a", (), (run(1, [], yielding=True), run(2, []), urgent_ready)), 0) is None
    assert for_ready_slot(Box("a", (), (run(1, []),)), 0) is None  # nothing waits ready
