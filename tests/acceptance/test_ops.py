"""Operations end to end: `gpuq serve` as a process with JSON logs, and `gpuq dev`."""

import json
import os
import signal
import subprocess
import sys
import threading

import anyio

from gpuq.agent import Agent
from tests.helpers import wait_count, wait_for


def _start_serve(dsn, *extra, level="info", **more_env):
    env = {**os.environ, "DATABASE_URL": dsn, "GPUQ_TOKENS": "ops-token", "GPUQ_LISTEN": "127.0.0.1:0",
           "GPUQ_LOG_FORMAT": "json", "GPUQ_POLL_SECONDS": "0.5", "GPUQ_LOG_LEVEL": level, **more_env}
    proc = subprocess.Popen([sys.executable, "-m", "gpuq.cli", "serve", *extra], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    lines: list[str] = []
    port: list[int] = []
    ready = threading.Event()

    def pump():
        for line in proc.stdout:
            lines.append(line)
            if '"server.listening"' in line:
                port.append(json.loads(line)["port"])
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True).start()
    return proc, lines, port, ready


async def test_serve_logs_json_lines_with_job_ids_and_exits_0_on_sigterm(dsn, pool):
    proc, lines, port, ready = _start_serve(dsn, level="debug")
    try:
        assert await anyio.to_thread.run_sync(ready.wait, 20) and port, proc.stderr.read()
        agent = Agent(f"ws://127.0.0.1:{port[0]}/agent", "ops-token", ["logged"], 4, lambda job: {"ok": 1}, "opsy")
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.run)
            ids = [r["id"] for r in await pool.fetch(
                "INSERT INTO gpuq.jobs (kind) SELECT 'logged' FROM generate_series(1, 20) RETURNING id")]
            await wait_count(pool, "done", 20, timeout=20)
            agent.stop()
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: proc.wait(20)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    events = [json.loads(line) for line in lines]  # every stdout line is one JSON object
    names = {e["event"] for e in events}
    assert {"server.listening", "agent.connected", "lease.batch", "job.done", "agent.disconnected",
            "dispatcher.drained", "server.stopped"} <= names
    done_ids = sorted(i for e in events if e["event"] == "job.done" for i in e["job_ids"])
    assert done_ids == sorted(ids)
    pushed = [e for e in events if e["event"] == "job.pushed"]  # one DEBUG line per job
    assert sorted(e["job_id"] for e in pushed) == sorted(ids) and all(e["level"] == "debug" for e in pushed)
    assert all("timestamp" in e and "level" in e for e in events)
    assert [e["event_loop"] for e in events if e["event"] == "server.listening"] == ["uvloop"]  # the default
    # Startup's objects are frozen out of the collector's scans: no full collection of them mid-run.
    assert [e["gc_frozen"] > 10_000 for e in events if e["event"] == "server.listening"] == [True]
    connected = [e for e in events if e["event"] == "agent.connected"]
    assert connected[0]["agent"].startswith("opsy#") and connected[0]["kinds"] == ["logged"]
    assert not any("ops-token" in line for line in lines)  # tokens are never logged


async def test_gpuq_event_loop_asyncio_runs_serve_on_the_standard_loop(dsn):
    proc, lines, port, ready = _start_serve(dsn, GPUQ_EVENT_LOOP="asyncio")
    try:
        assert await anyio.to_thread.run_sync(ready.wait, 20) and port, proc.stderr.read()
        proc.send_signal(signal.SIGTERM)
        assert await anyio.to_thread.run_sync(lambda: proc.wait(20)) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    listening = [json.loads(line) for line in lines if '"server.listening"' in line]
    assert listening[0]["event_loop"] == "asyncio"


def test_gpuq_dev_runs_end_to_end_from_a_clean_directory(tmp_path):
    # pytest's tmp_path is mode 700: as root, the server user cannot reach it,
    # so this also covers the fallback of the data to /var/tmp (symlinked).
    data = tmp_path / "dot-gpuq"
    res = subprocess.run([sys.executable, "-m", "gpuq.cli", "dev", "--duration", "3", "--port", "0",
                          "--agents", "2", "--rate", "40", "--data-dir", str(data)],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    last = [ln for ln in res.stdout.splitlines() if ln.startswith("stopped cleanly")][0]
    completed = int(last.split(" completed")[0].rsplit(" ", 1)[1])
    assert completed > 50
    assert "t=" in res.stdout and "agents 2" in res.stdout  # live progress lines
    assert "/ui  (admin token " in res.stdout  # the dashboard is on, with a token of its own
    assert (data / "pgdata" / "PG_VERSION").exists()  # data kept for the next run
    again = subprocess.run([sys.executable, "-m", "gpuq.cli", "dev", "--duration", "1", "--port", "0",
                            "--data-dir", str(data)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "migrations: up to date" in again.stdout  # the same cluster, reused
    if (data / "pgdata").is_symlink():
        import shutil

        shutil.rmtree((data / "pgdata").resolve().parent, ignore_errors=True)


def test_debug_lines_are_asked_for_once_per_batch_only_when_printed():
    import io

    import structlog

    from gpuq import logs

    saved, saved_level = structlog.get_config(), logs._level
    try:
        logs.configure("json", "info", io.StringIO())
        assert not logs.debug_enabled()
        logs.configure("json", "debug", io.StringIO())
        assert logs.debug_enabled()
    finally:
        structlog.configure(**saved)
        logs._level = saved_level


async def test_sigterm_ends_serve_while_its_database_hangs(dsn):
    """The database stops answering and closes nothing (a black-holed proxy): SIGTERM still ends
    `gpuq serve` within its drain deadline plus the bounded database shutdown. It once hung for
    ever: statements cancelled on a frozen socket waited for a CancelRequest that never came
    back, and the pool's graceful close with them."""
    from urllib.parse import urlsplit

    from gpuq.tcpproxy import TcpProxy

    parts = urlsplit(dsn)
    with TcpProxy(parts.port) as proxy:
        through = dsn.replace(f"{parts.hostname}:{parts.port}", f"127.0.0.1:{proxy.port}")
        proc, lines, port, ready = _start_serve(through, GPUQ_DRAIN_SECONDS="1")
        try:
            assert await anyio.to_thread.run_sync(ready.wait, 20) and port, proc.stderr.read()
            proxy.black_hole()
            await wait_for(lambda: _unhealthy(port[0]), timeout=30)  # its statements are stuck in the hang
            proc.send_signal(signal.SIGTERM)
            assert await anyio.to_thread.run_sync(lambda: proc.wait(30)) == 0  # generous: not for ever
        finally:
            if proc.poll() is None:
                proc.kill()
    assert any('"server.stopped"' in line for line in lines)


async def _unhealthy(port: int) -> bool:
    from gpuq.harness import fetch

    try:
        return (await anyio.to_thread.run_sync(lambda: fetch(f"http://127.0.0.1:{port}/healthz", timeout=3)))[0] == 503
    except OSError:
        return True  # no answer at all
