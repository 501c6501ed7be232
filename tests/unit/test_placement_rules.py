"""placement.py: which agents may run a shape's jobs, in what order, and why none can."""

from dataclasses import dataclass, field

from gpuq import placement
from gpuq.jobs import Shape
from gpuq.protocol import Device


@dataclass
class Box:
    """A connected agent as placement sees it."""

    id: str
    kinds: frozenset[str] = frozenset({"train"})
    version: int = 4
    draining: bool = False
    labels: frozenset[str] = frozenset()
    models: frozenset[str] = frozenset()
    devices: tuple[Device, ...] = ()
    free: int = 1
    used: set[int] = field(default_factory=set)
    queued: set[int] = field(default_factory=set)  # busy devices that hold a job ready already

    def free_devices(self, min_memory_mb: int) -> list[int]:
        return [d.index for d in self.devices if d.index not in self.used and d.memory_mb >= min_memory_mb]

    def ready_devices(self, min_memory_mb: int) -> list[int]:
        return [d.index for d in self.devices
                if d.index in self.used and d.index not in self.queued and d.memory_mb >= min_memory_mb]


def gpus(n: int, memory_mb: int = 81920) -> tuple[Device, ...]:
    return tuple(Device(i, "gpu", memory_mb) for i in range(n))


def shape(gpus: int = 0, memory: int | None = None, labels: tuple[str, ...] = (), model: str | None = None,
          kind: str = "train") -> Shape:
    return Shape(kind, "s", gpus, memory, frozenset(labels), model, False)


def test_hard_requirements_decide_who_could_run_it():
    big = Box("big", labels=frozenset({"gpu=h100"}), devices=gpus(4))
    small = Box("small", labels=frozenset({"gpu=a10"}), devices=gpus(1, 24576))
    old = Box("old", version=3, devices=gpus(8))
    assert placement.could_run(shape(2, 40000, ("gpu=h100",)), big)
    assert not placement.could_run(shape(2, 40000, ("gpu=h100",)), small)
    assert not placement.could_run(shape(1, 40000), small)  # too little memory
    assert placement.could_run(shape(1, 20000), small)
    assert not placement.could_run(shape(5), big)  # more devices than it has
    assert not placement.could_run(shape(1), old)  # cannot say what it has
    assert not placement.could_run(shape(1, kind="embed"), big)


def test_room_counts_free_devices_per_job_and_plain_credit_for_cpu_jobs():
    box = Box("b", devices=gpus(4), free=3, used={1})
    assert placement.room(shape(1), box) == 3
    assert placement.room(shape(2), box) == 1  # three free devices hold one 2-GPU job
    assert placement.room(shape(0, labels=("x",)), Box("c", labels=frozenset({"x"}), free=3)) == 3
    box.draining = True
    assert placement.room(shape(1), box) == 0


def test_warm_agents_come_first_then_the_rest_round_robin():
    warm = Box("warm", models=frozenset({"llama"}), devices=gpus(2))
    cold_a = Box("a", devices=gpus(2))
    cold_b = Box("b", devices=gpus(2))
    assert placement.slots(shape(1, model="llama"), [cold_a, warm, cold_b], 10) == [
        "warm", "warm", "a", "b", "a", "b"]
    assert placement.slots(shape(1, model="llama"), [cold_a, warm, cold_b], 3) == ["warm", "warm", "a"]
    assert placement.slots(shape(1), [cold_a, cold_b], 10) == ["a", "b", "a", "b"]
    assert placement.slots(shape(1, model="llama"), [cold_a, warm, cold_b], 10, warm_only=True) == ["warm", "warm"]
    assert placement.slots(shape(1), [cold_a, cold_b], 10, warm_only=True) == []


def test_a_model_counts_as_warm_somewhere_only_on_an_agent_that_could_run_the_job():
    llama = frozenset({"llama"})
    busy = Box("busy", models=llama, devices=gpus(1), used={0})
    assert placement.warm_somewhere(shape(1, model="llama"), [busy, Box("cold", devices=gpus(1))])  # busy or not
    assert not placement.warm_somewhere(shape(2, model="llama"), [busy])  # one device: it could never run it
    assert not placement.warm_somewhere(shape(1, model="llama"), [Box("leaving", models=llama, devices=gpus(1),
                                                                      draining=True)])
    assert not placement.warm_somewhere(shape(1, model="sdxl"), [busy])


def test_the_reason_names_the_first_requirement_nobody_meets():
    box = Box("b", labels=frozenset({"gpu=a10"}), devices=gpus(1, 24576))
    assert placement.why_unplaceable(shape(1), [box]) is None
    assert "kind embed" in placement.why_unplaceable(shape(1, kind="embed"), [box])
    assert "protocol 4" in placement.why_unplaceable(shape(1), [Box("o", version=2)])
    assert "gpu=h100" in placement.why_unplaceable(shape(1, labels=("gpu=h100",)), [box])
    assert "2 GPUs of at least 40000 MiB" in placement.why_unplaceable(shape(2, 40000), [box])
    assert placement.why_unplaceable(shape(1), []) == "no connected agent takes kind train"


def test_ready_room_is_one_job_per_busy_device_and_follows_the_same_rules():
    box = Box("b", devices=gpus(4), free=3, used={0, 1, 2}, queued={2})
    assert placement.room(shape(1), box, ready=True) == 2  # devices 0 and 1; 2 holds one ready already
    assert placement.room(shape(2), box, ready=True) == 1
    assert placement.room(shape(0), box, ready=True) == 0  # jobs without GPUs are ready in ``free``
    assert placement.room(shape(1, 100000), box, ready=True) == 0  # too little memory stays too little
    assert placement.room(shape(1), Box("d", devices=gpus(2), used={0}, draining=True), ready=True) == 0
    reserved = {"b": ("train", "other")}
    assert placement.room(shape(1), box, reserved, ready=True) == 0  # its devices wait for that shape
    warm = Box("w", devices=gpus(1), used={0}, models=frozenset({"m"}))
    assert placement.slots(shape(1, model="m"), [box, warm], 10, ready=True)[0] == "w"
    assert placement.slots(shape(1, model="m"), [box, warm], 10, ready=True, warm_only=True) == ["w"]
