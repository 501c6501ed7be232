"""The ledger of one agent connection on its own: credit, devices, started jobs, usage. No frames."""

from gpuq.protocol import Device, DeviceUsage, Done, Failed, Hello
from gpuq.protocol.ledger import UNKNOWN_KIND, Ledger, device_status

TOKEN = "00000000-0000-0000-0000-000000000001"
OTHER = "00000000-0000-0000-0000-000000000002"
GPUS = (Device(0, "H100", 81920), Device(1, "H100", 81920), Device(2, "L4", 1024))


def ledger(version: int = 6, capacity: int = 2, prefetch: int = 0, devices: tuple[Device, ...] = ()) -> Ledger:
    led = Ledger()
    led.open(Hello("a", ("embed",), capacity, version, devices, prefetch=prefetch))
    return led


def test_no_credit_before_the_hello_nor_after_stop_and_what_is_held_stays():
    led = Ledger()
    assert (led.free, led.free_devices(), led.ready_devices(), led.capacity) == (0, [], [], 0)
    led = ledger(devices=GPUS)
    assert led.free == 2 and led.free_devices() == [0, 1, 2]
    assert led.hold(1, TOKEN, "embed") == ()
    led.stop()
    assert (led.free, led.free_devices(), led.ready_devices()) == (0, [], [])
    assert led.held == {1: (TOKEN, "embed")}


def test_credit_is_capacity_plus_prefetch_minus_jobs_held_without_devices():
    led = ledger(capacity=2, prefetch=1)
    assert (led.capacity, led.prefetch, led.free) == (2, 1, 3)
    for i in (1, 2, 3):
        led.hold(i, TOKEN, "embed")
    assert led.free == 0
    assert ledger(version=4, capacity=2, prefetch=1).free == 2  # prefetch is version 5's


def test_an_outcome_frees_its_credit_only_with_the_held_token():
    led = ledger()
    led.hold(1, TOKEN, "embed")
    led.hold(2, TOKEN, "train")
    items, freed, _ran = led.settle([Done(1, OTHER, None), Failed(2, TOKEN, "x", True), Done(9, TOKEN, 1)])
    assert [kind for _, kind in items] == [UNKNOWN_KIND, "train", UNKNOWN_KIND] and freed == 1
    assert list(led.held) == [1] and led.free == 1
    assert led.holds(1, TOKEN) and not led.holds(1, OTHER) and not led.holds(2, TOKEN)


def test_started_unstarted_and_release_from_version_5():
    led = ledger(version=5, capacity=1, prefetch=2)
    for i in (1, 2, 3):
        led.hold(i, TOKEN, "embed")
    led.mark_started([1, 99])  # 99: not held here, nothing to track
    assert led.started == {1} and led.unstarted() == [2, 3] and led.started_ids() == [1]
    assert led.release([1, 2, 42]) == ((2, TOKEN),)  # a started job stays; one not held is ignored
    assert list(led.held) == [1, 3] and led.free == 1
    led.settle([Done(1, TOKEN, None)])
    assert led.started == set() and led.started_ids() == []


def test_before_version_5_every_held_job_counts_as_started():
    led = ledger(version=4)
    led.hold(1, TOKEN, "embed")
    assert led.unstarted() == [] and led.started_ids() == [1]


def test_a_job_with_gpus_takes_free_devices_with_enough_memory_instead_of_credit():
    led = ledger(devices=GPUS)
    assert led.hold(1, TOKEN, "train", gpus=2, min_memory_mb=2048) == (0, 1)
    assert led.free == 2 and led.free_devices() == [2] and led.free_devices(2048) == []
    assert led.hold(2, TOKEN, "train", gpus=1, min_memory_mb=2048) is None  # none left: nothing held
    assert 2 not in led.held
    led.settle([Done(1, TOKEN, None)])
    assert led.free_devices() == [0, 1, 2] and led.devices_in_use == {}


def test_a_busy_device_takes_one_ready_job_only_for_version_6_with_prefetch():
    led = ledger(prefetch=1, devices=GPUS[:2])
    led.hold(1, TOKEN, "train", gpus=1)
    led.hold(2, TOKEN, "train", gpus=1)
    assert led.free_devices() == [] and led.ready_devices() == [0, 1]
    assert led.hold(3, TOKEN, "train", gpus=1) == (0,)  # waits behind job 1
    assert led.ready_devices() == [1] and led.hold(4, TOKEN, "train", gpus=2) is None
    for older in (ledger(version=5, prefetch=1, devices=GPUS[:2]), ledger(prefetch=0, devices=GPUS[:2])):
        older.hold(1, TOKEN, "train", gpus=2)
        assert older.ready_devices() == [] and older.hold(2, TOKEN, "train", gpus=1) is None


def test_device_status_shows_usage_the_running_job_and_the_next():
    led = ledger(prefetch=1, devices=GPUS[:2])
    led.record_usage([DeviceUsage(0, 35, 1024), DeviceUsage(7, 1, 1)])  # 7: not one of its devices
    assert led.usage == {0: DeviceUsage(0, 35, 1024)}
    led.hold(1, TOKEN, "train", gpus=2)
    led.hold(2, TOKEN, "train", gpus=1)  # waits behind job 1 on device 0
    led.mark_started([1])
    assert led.device_jobs() == ({0: 1, 1: 1}, {0: 2})
    assert device_status(led) == [
        {"index": 0, "name": "H100", "memory_mb": 81920, "memory_used_mb": 1024, "utilization": 35,
         "job": 1, "next": 2, "quarantined": None},
        {"index": 1, "name": "H100", "memory_mb": 81920, "memory_used_mb": None, "utilization": None,
         "job": 1, "next": None, "quarantined": None},
    ]
    old = ledger(version=4, devices=GPUS[:1])
    old.hold(1, TOKEN, "train", gpus=1)
    assert old.device_jobs() == ({0: 1}, {})  # before version 5 a pushed job runs


def test_a_held_job_s_model_is_held_until_its_outcome_or_its_release():
    led = ledger(version=5, capacity=1, prefetch=2, devices=GPUS)
    led.hold(1, TOKEN, "train", gpus=1, model="llama")
    led.hold(2, TOKEN, "train", gpus=1, model="sdxl")
    led.hold(3, TOKEN, "embed")  # no model named
    assert led.held_models == {1: "llama", 2: "sdxl"}
    led.settle([Done(1, OTHER, None)])  # not its token: still held
    led.settle([Done(1, TOKEN, None)])
    assert led.release([2]) == ((2, TOKEN),)
    assert led.held_models == {}


def test_a_job_s_run_time_is_from_its_started_to_its_outcome_not_from_its_push():
    """Fair share charges run time: a prefetched job's wait in the agent is not in it."""
    led = ledger(version=5, capacity=1, prefetch=1)
    led.hold(1, TOKEN, "embed")
    led.hold(2, TOKEN, "embed")
    led.mark_started([1], now=10.0)
    led.mark_started([1], now=11.0)  # told again (a resend): the first start holds
    _items, _freed, ran = led.settle([Done(1, TOKEN, None)], now=12.5)
    assert ran == {1: 2.5}
    led.mark_started([2], now=14.0)
    _items, _freed, ran = led.settle([Done(2, OTHER, None), Failed(2, TOKEN, "x", True)], now=14.25)
    assert ran == {2: 0.25}  # the stale token's outcome has none
    assert led.started_at == {}
