"""Quarantine of bad GPUs (issue #33 part 4), through real agents, a real server and PostgreSQL:
repeated DeviceError faults quarantine a device, which then gets no new job; an Xid quarantines
at once; an admin clears it (the API the CLI and the dashboard call); the quarantine outlives the
agent's connection; a job that failed on a device is retried on another one that fits."""

import json

import pytest
import structlog

from gpuq import admin, fairlease, quarantine, queue
from gpuq.agent import DeviceError
from gpuq.harness import TOKEN, http_get, next_of, raw_agent, running_server
from gpuq.jobs import NewJob
from gpuq.producer import enqueue
from gpuq.protocol import Device
from tests.helpers import dispatcher_idle, wait_for

H100S = [Device(0, "h100", 81920), Device(1, "h100", 81920)]
ONE = [Device(0, "h100", 81920)]


async def status(srv) -> dict:
    return json.loads((await http_get(f"{srv.http}/status", token=TOKEN))[2])


async def states(conn, ids: list[int]) -> list[str]:
    rows = dict(await conn.fetch("SELECT id, status::text FROM gpuq.jobs WHERE id = ANY($1)", ids))
    return [rows[i] for i in ids]


async def make_due(conn, job_id: int) -> None:
    """Its retry due now instead of after the backoff (the sweeper promotes it)."""
    await conn.execute("UPDATE gpuq.jobs SET run_at = now() WHERE id = $1 AND status = 'scheduled'", job_id)


async def test_repeated_device_errors_quarantine_a_gpu_that_then_gets_no_new_job_until_cleared(dsn, live_conn):
    runs: list = []
    broken = {0}

    async def handler(job):
        runs.append((job.id, job.devices))
        if bad := broken & set(job.devices):
            raise DeviceError("CUDA error: uncorrectable ECC error encountered", devices=bad)
        return list(job.devices)

    async with running_server(dsn, poll_seconds=60, quarantine_faults=2) as srv:
        await srv.agent(["train"], 1, handler, "box", devices=H100S)
        first = [await enqueue(live_conn, "train", gpus=2, max_attempts=1) for _ in range(2)]

        async def quarantined() -> bool:  # as placement sees it (the agent's devices), both jobs ended
            return ((await status(srv))["agents"][0]["devices"][0]["quarantined"] is not None
                    and await states(live_conn, first) == ["dead", "dead"])

        await wait_for(quarantined)
        body = await status(srv)
        [q] = body["quarantined"]
        assert (q["device"], q["faults"]) == ("box:0", 2) and "2 device faults" in q["reason"]
        assert "uncorrectable ECC" in q["reason"]
        devices = body["agents"][0]["devices"]
        assert devices[0]["quarantined"] == q["reason"] and devices[1]["quarantined"] is None

        later = [await enqueue(live_conn, "train", gpus=1) for _ in range(3)]
        both = await enqueue(live_conn, "train", gpus=2)

        async def ran_later() -> bool:
            return await states(live_conn, later) == ["done"] * 3

        await wait_for(ran_later)
        await dispatcher_idle()
        assert [d for i, d in runs if i in later] == [(1,), (1,), (1,)]  # never device 0
        assert await states(live_conn, [both]) == ["pending"]  # one device is all it has now

        broken.clear()  # repaired; an admin clears it (gpuq device clear box:0)
        assert await quarantine.clear(live_conn, "box", 0) == [0]

        async def ran_both() -> bool:
            return await states(live_conn, [both]) == ["done"]

        await wait_for(ran_both)
        assert (await status(srv))["quarantined"] == []
    assert await live_conn.fetchval("SELECT count(*) FROM gpuq.device_faults") == 0  # cleared with it


async def test_an_xid_quarantines_at_once_and_a_version_8_agent_cannot_report_one(dsn, live_conn):
    async with running_server(dsn, poll_seconds=60) as srv:
        devices = [{"index": 0, "name": "h100", "memory_mb": 81920}]
        old, _ = await raw_agent(srv, ("train",), name="old", protocol=8, devices=devices, labels=[], models=[],
                                 prefetch=0, batch=0)
        fault = {"type": "device_fault", "devices": [0], "source": "xid", "error": "Xid 79", "job": None}
        await old.send(json.dumps(fault))
        assert (await next_of(old, "error"))["code"] == "unexpected"
        ws, _ = await raw_agent(srv, ("train",), name="new", protocol=9, devices=devices, labels=[], models=[],
                                prefetch=0, batch=0)
        await ws.send(json.dumps(fault))

        async def quarantined() -> bool:  # as placement sees it: the agent's devices
            new = next(a for a in (await status(srv))["agents"] if a["agent"].startswith("new#"))
            return new["devices"][0]["quarantined"] is not None

        await wait_for(quarantined)
        assert [(q["device"], q["reason"], q["faults"]) for q in (await status(srv))["quarantined"]] == [
            ("new:0", "xid: Xid 79", 1)]
        job = await enqueue(live_conn, "train", gpus=1)
        assert (await next_of(old, "jobs"))["jobs"][0]["id"] == job  # the old agent's device is fine
        await ws.close()
        await old.close()


async def test_the_quarantine_outlives_the_connection_and_a_new_one_reads_it_first(dsn, live_conn):
    runs: list = []

    async def handler(job):
        runs.append(job.devices)

    from tests.integration.test_ui import READ, UI, _admin_headers, request

    await quarantine.quarantine(live_conn, "box", 0, "by hand: fan failure")  # gpuq device quarantine box:0
    async with running_server(dsn, poll_seconds=60, **UI) as srv:
        jobs = [await enqueue(live_conn, "train", gpus=1) for _ in range(2)]
        await srv.agent(["train"], 1, handler, "box", devices=H100S)

        async def done() -> bool:
            return await states(live_conn, jobs) == ["done", "done"]

        await wait_for(done)
        assert runs == [(1,), (1,)]
        assert (await status(srv))["agents"][0]["devices"][0]["quarantined"] == "by hand: fan failure"
        _, _, body = await request(srv.port, "GET", "/ui/agents", await _admin_headers(srv.port, READ))
        device = body.split('data-device="0"', 1)[1].split("</div>", 1)[0]
        assert "quarantined</strong> (by hand: fan failure" in device


async def test_a_job_that_failed_on_a_device_is_retried_on_another_that_fits(dsn, live_conn):
    runs: list = []

    def on(name: str, fails: bool):
        async def handler(job):
            runs.append((name, job.devices))
            if fails:
                raise DeviceError("NCCL error: unhandled cuda error")
        return handler

    from tests.integration.test_ui import READ, UI, _admin_headers, request

    async with running_server(dsn, poll_seconds=60, **UI) as srv:
        await srv.agent(["train"], 1, on("a", True), "a", devices=ONE)
        job = await enqueue(live_conn, "train", gpus=1, max_attempts=3)

        async def failed(n: int):
            async def check() -> bool:
                return await live_conn.fetchval("SELECT attempts FROM gpuq.jobs WHERE id = $1 AND status = "
                                                "'scheduled'", job) == n
            return check

        await wait_for(await failed(1))
        assert (await admin.show(live_conn, job))["failed_devices"] == ["a:0"]  # gpuq show, the job page
        _, _, body = await request(srv.port, "GET", f"/ui/jobs/{job}", await _admin_headers(srv.port, READ))
        assert '<span id="job-failed-devices">last failed on a:0</span>' in body
        await make_due(live_conn, job)  # no other device: it goes back to the one it failed on
        await wait_for(await failed(2))
        await srv.agent(["train"], 1, on("b", False), "b", devices=ONE)
        await make_due(live_conn, job)

        async def done() -> bool:
            return await states(live_conn, [job]) == ["done"]

        await wait_for(done)
    assert runs == [("a", (0,)), ("a", (0,)), ("b", (0,))]  # without the move: a again, and dead


async def test_every_placed_lease_returns_the_devices_a_job_failed_on_and_its_checkpoint(conn):
    """The placed lease, the limited one and fair share's: each leased job comes with the devices
    its last attempt failed on (placement moves it off them) and its checkpoint (its resume_from)."""
    await queue.enqueue_many(conn, [NewJob("train", gpus=1, tenant="t") for _ in range(3)])
    await conn.execute("""UPDATE gpuq.jobs SET failed_devices = '{a:0}', checkpoint = '{"step": 50}'""")
    (shape,) = await queue.read_shapes(conn)
    leased = [*await queue.lease_placed(conn, shape, ["b#1"], 30),
              *await queue.lease_limited(conn, shape, ["b#1"], 30, scan_keys=False),
              *(j for j, _, _ in await fairlease.lease_placed_fair(conn, shape, ["t"], ["b#1"], 30))]
    assert [(j.failed_devices, json.loads(j.resume_json or "null")) for j in leased] == [(("a:0",), {"step": 50})] * 3


# -- the controls: gpuq device, gpuq status, the dashboard ----------------------------


@pytest.fixture
def logging_kept():
    """The CLI's admin events point structlog at the captured stderr: put it back afterwards."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)


def test_gpuq_device_lists_quarantines_and_clears_and_gpuq_status_shows_them(dsn, capsys, logging_kept):
    from gpuq.cli import main

    def gpuq(*argv: str) -> tuple[int, str, str]:
        code = main([*argv, "--database-url", dsn])
        out = capsys.readouterr()
        return code, out.out, out.err

    assert gpuq("device") == (0, "no device is quarantined\n", "")
    code, out, err = gpuq("device", "quarantine", "box:1", "--reason", "fan failure")
    assert (code, out) == (0, "box:1: quarantined: it takes no new job\n") and '"event": "admin.device_quarantine"' in err
    assert gpuq("device", "quarantine", "box:1")[:2] == (0, "box:1: quarantined already\n")
    code, out, _ = gpuq("device", "list")
    assert out.splitlines()[0].split() == ["device", "since", "faults", "reason"]
    assert out.splitlines()[1].split()[0] == "box:1" and out.splitlines()[1].endswith("0  fan failure")
    assert "quarantined: box:1 since " in gpuq("status")[1] and "(fan failure; gpuq device clear box:1)" in gpuq("status")[1]
    code, out, err = gpuq("device", "clear", "box")  # every device of it
    assert (code, out) == (0, "box:1: cleared: it takes new jobs again\n") and '"event": "admin.device_clear"' in err
    assert gpuq("device", "clear", "box:1")[:2] == (1, "box:1: not quarantined\n")
    for argv, says in ((["device", "clear"], "gpuq device clear AGENT[:INDEX]"),
                       (["device", "quarantine", "box"], "name the device to quarantine"),
                       (["device", "clear", "bad name:0"], "bad device 'bad name:0'")):
        code, _, err = gpuq(*argv)
        assert code == 1 and says in err, (argv, err)


async def test_the_controls_page_lists_quarantined_gpus_and_only_an_admin_clears_one(dsn, pool):
    from structlog.testing import capture_logs

    from tests.integration.test_ui import READ, UI, _admin_headers, request

    await quarantine.quarantine(pool, "box", 0, "xid: Xid 79")
    async with running_server(dsn, **UI) as srv:
        read_only = await _admin_headers(srv.port, READ)
        _, _, body = await request(srv.port, "GET", "/ui/controls", read_only)
        row = body.split('<tr data-device="box:0">', 1)[1].split("</tr>", 1)[0]
        assert "xid: Xid 79" in row and "/ui/devices/clear" not in body  # read-only: no Clear
        assert (await request(srv.port, "POST", "/ui/devices/clear?device=box%3A0", read_only))[0] == 403
        assert [q["device"] for q in await quarantine.listing(pool)] == ["box:0"]
        admin = await _admin_headers(srv.port)
        _, _, body = await request(srv.port, "GET", "/ui/controls", admin)
        assert 'hx-post="/ui/devices/clear?device=box%3A0"' in body
        with capture_logs() as logged:
            status, _, body = await request(srv.port, "POST", "/ui/devices/clear?device=bad%20name", admin)
            assert status == 400 and "bad device" in body
            assert (await request(srv.port, "POST", "/ui/devices/clear?device=box%3A0", admin))[0] == 204
            status, _, body = await request(srv.port, "POST", "/ui/devices/clear?device=box%3A0", admin)
            assert status == 404 and "not quarantined" in body
        assert await quarantine.listing(pool) == []
        assert [(e["action"], e["device"], e["cleared"]) for e in logged if e["event"] == "ui.action"] == [
            ("clear_device", "box:0", [0]), ("clear_device", "box:0", [])]
        _, _, body = await request(srv.port, "GET", "/ui/controls", admin)
        assert 'data-device="box:0"' not in body


async def test_a_quarantine_whose_notification_was_missed_is_read_again_soon(dsn, live_conn):
    async def noop(job):
        return None

    from gpuq.dispatcher.tuning import Tuning

    async with running_server(dsn, poll_seconds=60, tuning=Tuning(fleet_refresh_seconds=0.5)) as srv:
        await srv.agent(["train"], 1, noop, "box", devices=H100S)
        # As if the notification were lost (LISTEN down, or a server that only polls): none is sent.
        await live_conn.execute("INSERT INTO gpuq.quarantined_devices (agent, device, reason) VALUES ('box', 1, 'x')")

        async def read() -> bool:
            agents = (await status(srv))["agents"]  # the agent may not be listed yet
            return bool(agents) and agents[0]["devices"][1]["quarantined"] == "x"

        await wait_for(read)  # within fleet_refresh_seconds (0.5 s here, 2 s by default)
