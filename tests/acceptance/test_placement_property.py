"""Property: over random fleets and jobs, through the real server, dispatcher and database,
no job runs where a hard requirement fails and no device runs two jobs at once (issue #16)."""

from __future__ import annotations

import anyio
import asyncpg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuq import placement
from gpuq.harness import running_server
from gpuq.jobs import Shape
from gpuq.producer import enqueue
from gpuq.protocol import Device
from tests.helpers import dispatcher_idle, wait_for

LABELS = ["gpu=h100", "region=eu"]

agents = st.lists(st.fixed_dictionaries({
    "memory": st.lists(st.sampled_from([24576, 81920]), max_size=4),
    "labels": st.lists(st.sampled_from(LABELS), unique=True),
    "capacity": st.integers(1, 2),
}), min_size=1, max_size=3)
jobs = st.lists(st.fixed_dictionaries({
    "gpus": st.integers(0, 3),
    "memory": st.sampled_from([None, 40000]),
    "labels": st.lists(st.sampled_from(LABELS), unique=True, max_size=1),
}), min_size=1, max_size=12)


class Fleet:
    """What each handler saw: violations of the rules, and the jobs that ran."""

    def __init__(self) -> None:
        self.in_use: dict[str, set[int]] = {}
        self.ran: set[int] = set()
        self.violations: list[str] = []

    def handler(self, name: str, devices: tuple[Device, ...], labels: set[str], wanted: dict[int, dict]):
        memory = {d.index: d.memory_mb for d in devices}
        self.in_use[name] = set()

        async def run(job):
            need = wanted[job.id]
            given_ = set(job.devices)
            if len(job.devices) != need["gpus"] or len(given_) != len(job.devices):
                self.violations.append(f"job {job.id} got devices {job.devices}, needs {need['gpus']}")
            if any(memory.get(i, 0) < (need["memory"] or 0) for i in given_):
                self.violations.append(f"job {job.id} got too little memory on {name}")
            if not set(need["labels"]) <= labels:
                self.violations.append(f"job {job.id} ran on {name} without {need['labels']}")
            if given_ & self.in_use[name]:
                self.violations.append(f"job {job.id} shares devices {given_ & self.in_use[name]} on {name}")
            self.in_use[name] |= given_
            await anyio.sleep(0.02)  # not a settle wait: the job holds its devices a while, so overlaps show
            self.in_use[name] -= given_
            self.ran.add(job.id)
        return run


def _shape(job: dict) -> Shape:
    return Shape("train", "expected", job["gpus"], job["memory"] if job["gpus"] else None, frozenset(job["labels"]),
                 None, False)


async def _scenario(dsn: str, fleet_spec: list[dict], job_specs: list[dict]) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute("TRUNCATE gpuq.jobs, gpuq.shapes")
        fleet, wanted = Fleet(), {}
        async with running_server(dsn, poll_seconds=60) as srv:
            described = []
            for i, spec in enumerate(fleet_spec):
                devices = tuple(Device(d, "gpu", m) for d, m in enumerate(spec["memory"]))
                labels = set(spec["labels"])
                await srv.agent(["train"], spec["capacity"], fleet.handler(f"a{i}", devices, labels, wanted),
                                f"a{i}", devices=devices, labels=sorted(labels))
                described.append(_Described(f"a{i}", devices, labels))
            placeable = set()
            for spec in job_specs:
                memory = spec["memory"] if spec["gpus"] else None
                job_id = await enqueue(conn, "train", gpus=spec["gpus"], gpu_memory_mb=memory,
                                       labels=spec["labels"])
                wanted[job_id] = {**spec, "memory": memory}
                if any(placement.could_run(_shape(spec), a) for a in described):
                    placeable.add(job_id)

            async def placeable_done() -> bool:
                return fleet.ran >= placeable

            await wait_for(placeable_done, timeout=20)
            await dispatcher_idle()  # idle with every agent free: anything wrongly placed has run by now
        assert fleet.violations == []
        assert fleet.ran == placeable
        pending = {r[0] for r in await conn.fetch("SELECT id FROM gpuq.jobs WHERE status = 'pending'")}
        assert pending == set(wanted) - placeable
    finally:
        await conn.close()


class _Described:
    """An agent as placement sees it, from what it said (for the expected outcome)."""

    def __init__(self, name: str, devices: tuple[Device, ...], labels: set[str]) -> None:
        self.id, self.kinds, self.version, self.draining = name, frozenset({"train"}), 4, False
        self.labels, self.models, self.devices = frozenset(labels), frozenset(), devices
        self.free = 1

    def free_devices(self, min_memory_mb: int) -> list[int]:
        return [d.index for d in self.devices if d.memory_mb >= min_memory_mb]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(agents, jobs)
def test_hard_requirements_hold_and_devices_are_never_shared(dsn, fleet_spec, job_specs):
    anyio.run(_scenario, dsn, fleet_spec, job_specs)
