"""The gpuq command, run as a real subprocess."""

import json
import os
import subprocess
import sys

import pytest

from gpuq.config import ConfigError
from gpuq.runtime import use_uvloop

SUBCOMMANDS = ["migrate", "serve", "sweep", "agent", "enqueue", "status", "jobs", "show", "cancel", "preempt", "pause", "resume",
               "retry", "schedule", "wait", "kind-timeout", "limit", "batch", "tenant", "device", "dev", "bench"]


def gpuq(*args, env=None, stdin=None, timeout=60):
    # Only the DATABASE_URL a test gives: never one from the outer environment.
    full_env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    full_env.update(env or {})
    return subprocess.run([sys.executable, "-m", "gpuq.cli", *args], capture_output=True, text=True,
                          env=full_env, input=stdin, timeout=timeout)


@pytest.mark.parametrize("command", [[], *[[c] for c in SUBCOMMANDS]])
def test_help_works_for_every_command(command):
    res = gpuq(*command, "--help")
    assert res.returncode == 0, res.stderr
    assert "usage: gpuq" in res.stdout


def test_enqueue_then_status_shows_the_job(dsn):
    env = {"DATABASE_URL": dsn}
    res = gpuq("enqueue", "embed", '{"text": "hi"}', "--priority", "3", env=env)
    assert res.returncode == 0, res.stderr
    job_id = int(res.stdout.strip())
    assert job_id >= 1
    res = gpuq("status", "--json", env=env)
    assert res.returncode == 0, res.stderr
    body = json.loads(res.stdout)
    assert body["live"]["pending"] == {"embed": 1}
    assert body["totals"] == {"pending": 1, "leased": 0, "scheduled": 0}
    table = gpuq("status", env=env)
    assert "embed" in table.stdout and "oldest pending" in table.stdout


def test_bulk_enqueue_from_stdin(dsn):
    lines = "\n".join(json.dumps({"kind": "k", "payload": {"i": i}}) for i in range(25)) + "\n"
    res = gpuq("enqueue", "--stdin", "--batch", "10", env={"DATABASE_URL": dsn}, stdin=lines)
    assert res.returncode == 0, res.stderr
    assert "enqueued 25 jobs" in res.stdout
    body = json.loads(gpuq("status", "--json", env={"DATABASE_URL": dsn}).stdout)
    assert body["totals"]["pending"] == 25


def test_bad_stdin_line_is_one_clear_error(dsn):
    res = gpuq("enqueue", "--stdin", env={"DATABASE_URL": dsn}, stdin='{"kind": "k"}\nnot json\n')
    assert res.returncode != 0
    assert res.stderr.strip().startswith("gpuq: error: stdin line 2")


def _one_clear_line(res):
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("gpuq: error:"), res.stderr
    return lines[0]


def test_unreachable_database_is_one_clear_line():
    line = _one_clear_line(gpuq("status", env={"DATABASE_URL": "postgresql://nobody:secret@127.0.0.1:1/x"}))
    assert "cannot connect" in line and "secret" not in line  # the password is never printed


def test_missing_database_url_is_one_clear_line():
    assert "DATABASE_URL" in _one_clear_line(gpuq("migrate", env={}))


@pytest.mark.parametrize("args", [
    ["enqueue", "bad,kind"], ["enqueue", "ok", "{not json"], ["enqueue", "ok", "--priority", "99999"],
])
def test_bad_enqueue_input_is_one_clear_line(dsn, args):
    _one_clear_line(gpuq(*args, env={"DATABASE_URL": dsn}))


def test_serve_refuses_an_unmigrated_database(server_dsn):
    import asyncio

    import asyncpg

    async def drop():
        conn = await asyncpg.connect(server_dsn)
        await conn.execute("DROP SCHEMA IF EXISTS gpuq CASCADE")
        await conn.close()

    asyncio.run(drop())
    line = _one_clear_line(gpuq("serve", env={"DATABASE_URL": server_dsn, "GPUQ_TOKENS": "t",
                                              "GPUQ_LISTEN": "127.0.0.1:0"}))
    assert "gpuq migrate" in line


def test_serve_without_tokens_and_bad_settings_are_clear(dsn):
    assert "GPUQ_TOKENS" in _one_clear_line(gpuq("serve", env={"DATABASE_URL": dsn}))
    line = _one_clear_line(gpuq("serve", env={"DATABASE_URL": dsn, "GPUQ_TOKENS": "t",
                                              "GPUQ_LEASE_SECONDS": "soon"}))
    assert "GPUQ_LEASE_SECONDS" in line


def test_a_bad_event_loop_setting_is_one_clear_line(dsn):
    line = _one_clear_line(gpuq("serve", env={"DATABASE_URL": dsn, "GPUQ_TOKENS": "t",
                                              "GPUQ_EVENT_LOOP": "trio"}))
    assert "GPUQ_EVENT_LOOP" in line and "uvloop" in line


def test_event_loop_choice():
    assert use_uvloop({}) is True  # uvloop is a dependency: auto picks it
    assert use_uvloop({"GPUQ_EVENT_LOOP": " UVLOOP "}) is True
    assert use_uvloop({"GPUQ_EVENT_LOOP": "asyncio"}) is False
    with pytest.raises(ConfigError, match="GPUQ_EVENT_LOOP"):
        use_uvloop({"GPUQ_EVENT_LOOP": "fast"})


def test_agent_with_a_bad_handler_is_one_clear_line():
    line = _one_clear_line(gpuq("agent", "--token", "t", "--kinds", "x", "--handler", "no.such.module:fn"))
    assert "no.such.module" in line


def test_migrate_twice(server_dsn):
    first = gpuq("migrate", env={"DATABASE_URL": server_dsn})
    assert first.returncode == 0, first.stderr
    again = gpuq("migrate", env={"DATABASE_URL": server_dsn})
    assert again.returncode == 0 and again.stdout.strip() == "up to date"


def test_sweep_once(dsn):
    res = gpuq("sweep", "--once", env={"DATABASE_URL": dsn})
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"reclaimed": 0, "dead": 0, "promoted": 0,
                                                                 "schedules_fired": 0, "timed_out": 0, "pruned": 0}


def test_pause_resume_and_retry_from_the_shell_name_who_did_it(dsn):
    env = {"DATABASE_URL": dsn, "GPUQ_LOG_FORMAT": "json"}
    res = gpuq("pause", "embed", env=env)
    assert res.returncode == 0 and res.stdout.strip() == "embed: paused", res.stderr
    event = json.loads(res.stderr.strip().splitlines()[-1])
    assert event["event"] == "admin.pause" and event["kind"] == "embed" and event["by"]
    body = json.loads(gpuq("status", "--json", env=env).stdout)
    assert body["paused"]["embed"]["by"] == event["by"]
    assert "paused: embed" in gpuq("status", env=env).stdout
    assert gpuq("pause", "embed", env=env).stdout.strip() == "embed: already paused"
    assert gpuq("resume", "embed", env=env).stdout.strip() == "embed: resumed"
    res = gpuq("retry", "--kind", "embed", "--dry-run", env=env)
    assert res.returncode == 0 and res.stdout.startswith("0 dead or cancelled job(s) would go back"), res.stderr
    res = gpuq("retry", "--kind", "embed", env=env)
    assert json.loads(res.stderr.strip().splitlines()[-1])["event"] == "admin.retry"


def test_retry_without_ids_or_filters_is_one_clear_line(dsn):
    res = gpuq("retry", env={"DATABASE_URL": dsn})
    assert res.returncode == 1
    assert res.stderr.strip() == ("gpuq: error: retry needs job ids or at least one filter "
                                  "(kind, error text, time range, state, key)")
    res = gpuq("retry", "--since", "yesterday", env={"DATABASE_URL": dsn})
    assert res.returncode == 2 and "not an ISO 8601 time" in res.stderr


def test_a_preemptible_job_from_the_shell_and_preempt_of_one_not_running(dsn):
    env = {"DATABASE_URL": dsn, "GPUQ_LOG_FORMAT": "json"}
    res = gpuq("enqueue", "train", "--preemptible", "--grace", "5", "--max-preemptions", "2", env=env)
    assert res.returncode == 0, res.stderr
    job_id = int(res.stdout)
    shown = json.loads(gpuq("show", str(job_id), env=env).stdout)
    assert (shown["preemptible"], shown["grace_seconds"], shown["max_preemptions"], shown["preemptions"]) == (
        True, 5, 2, 0)
    res = gpuq("preempt", str(job_id), env=env)
    assert res.returncode == 1 and res.stdout.startswith(f"{job_id}: not preempted (not running")
    assert json.loads(res.stderr.strip().splitlines()[-1])["event"] == "admin.preempt"


def test_cancel_and_show_from_the_shell(dsn):
    env = {"DATABASE_URL": dsn, "GPUQ_LOG_FORMAT": "json"}
    job_id = int(gpuq("enqueue", "embed", '{"text": "hi"}', env=env).stdout)
    shown = json.loads(gpuq("show", str(job_id), env=env).stdout)
    assert shown["status"] == "pending" and shown["payload"] == {"text": "hi"} and shown["kind"] == "embed"
    res = gpuq("cancel", str(job_id), "999999", env=env)
    assert res.returncode == 1  # one of them was not live
    assert res.stdout.splitlines() == [f"{job_id}: cancelled (was pending)",
                                       "999999: not live (finished, or no such job)"]
    assert json.loads(res.stderr.strip().splitlines()[-1])["event"] == "admin.cancel"
    assert json.loads(gpuq("show", str(job_id), env=env).stdout)["status"] == "cancelled"
    res = gpuq("retry", str(job_id), env=env)
    assert res.returncode == 0 and res.stdout.strip() == "1 dead or cancelled job(s) sent back to pending"
    assert json.loads(gpuq("show", str(job_id), env=env).stdout)["status"] == "pending"
    res = gpuq("show", "999999", env=env)
    assert res.returncode == 1 and res.stderr.strip() == "gpuq: error: no job 999999"
    assert json.loads(gpuq("show", str(job_id), env=env).stdout)["failed_attempts"] == []


def test_list_jobs_from_the_shell_a_page_at_a_time(dsn):
    env = {"DATABASE_URL": dsn, "GPUQ_LOG_FORMAT": "json"}
    ids = [int(gpuq("enqueue", "embed", "{}", env=env).stdout) for _ in range(3)]
    res = gpuq("jobs", "--kind", "embed", "--limit", "2", env=env)
    lines = res.stdout.splitlines()
    assert res.returncode == 0 and lines[0].split() == ["id", "kind", "state", "attempts", "created", "error"]
    assert [int(ln.split()[0]) for ln in lines[1:3]] == [ids[2], ids[1]]
    assert lines[-1] == f"older: gpuq jobs ... --before {ids[1]}"
    page = json.loads(gpuq("jobs", "--state", "pending", "--before", str(ids[1]), "--json", env=env).stdout)
    assert [j["id"] for j in page["jobs"]] == [ids[0]] and page["older"] is None
    res = gpuq("jobs", "--state", "running", env=env)
    assert res.returncode == 1 and "state must be one of" in res.stderr
    res = gpuq("jobs", "--kind", "a b", env=env)
    assert res.returncode == 1 and "bad job kind 'a b'" in res.stderr


def test_schedule_add_list_and_remove_from_the_shell(dsn):
    env = {"DATABASE_URL": dsn, "GPUQ_LOG_FORMAT": "json"}
    res = gpuq("schedule", "add", "refresh", "--cron", "*/5 * * * *", "--kind", "embed", "--payload", '{"a": 1}',
               env=env)
    assert res.returncode == 0 and res.stdout.startswith("refresh: first run at "), res.stderr
    event = json.loads(res.stderr.strip().splitlines()[-1])
    assert event["event"] == "admin.schedule_add" and event["cron"] == "*/5 * * * *" and event["by"]
    [listed] = json.loads(gpuq("schedule", "list", "--json", env=env).stdout)
    assert (listed["name"], listed["kind"], listed["payload"]) == ("refresh", "embed", {"a": 1})
    assert "refresh  '*/5 * * * *'  kind=embed" in gpuq("schedule", "list", env=env).stdout
    res = gpuq("schedule", "add", "bad", "--cron", "sometimes", "--kind", "embed", env=env)
    assert res.returncode == 1 and "bad cron expression" in res.stderr
    assert gpuq("schedule", "remove", "refresh", env=env).stdout.strip() == "refresh: removed"
    res = gpuq("schedule", "remove", "refresh", env=env)
    assert res.returncode == 1 and res.stdout.strip() == "refresh: no such schedule"


def test_wait_from_the_shell(dsn):
    import asyncio

    import asyncpg

    env = {"DATABASE_URL": dsn}
    job_id = int(gpuq("enqueue", "embed", "{}", env=env).stdout)
    res = gpuq("wait", str(job_id), "--timeout", "0.3", env=env)
    assert res.returncode == 1 and res.stderr.strip() == f"gpuq: error: job {job_id} did not end within 0.3 s"

    async def finish():
        c = await asyncpg.connect(dsn)
        await c.execute("UPDATE gpuq.jobs SET status = 'done', result = '{\"ok\": 1}' WHERE id = $1", job_id)
        await c.close()

    asyncio.run(finish())
    res = gpuq("wait", str(job_id), env=env)
    assert res.returncode == 0 and json.loads(res.stdout) == {"ok": 1}
    other = int(gpuq("enqueue", "embed", "{}", env=env).stdout)
    gpuq("cancel", str(other), env=env)
    res = gpuq("wait", str(other), env=env)
    assert res.returncode == 1 and "was cancelled" in res.stderr


async def test_wait_from_the_shell_goes_on_when_its_database_host_hangs(dsn, pool):
    """`gpuq wait` on a multi-host DATABASE_URL whose first host stops answering (closing
    nothing): its silent connection is probed, dropped, and the wait goes on on the next host."""
    from urllib.parse import urlsplit

    import anyio

    from gpuq.sql import queries
    from gpuq.tcpproxy import TcpProxy
    from tests.helpers import add_pending, wait_for

    parts = urlsplit(dsn)
    [job_id] = await add_pending(pool, 1)

    async def waiting() -> bool:
        return await pool.fetchval("SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' AND query = $1",
                                   queries["job_outcome"]) >= 1

    with TcpProxy(parts.port) as proxy:
        hosts = f"127.0.0.1:{proxy.port},{parts.hostname}:{parts.port}"
        env = {"DATABASE_URL": dsn.replace(f"{parts.hostname}:{parts.port}", hosts) + "?target_session_attrs=read-write",
               "GPUQ_CONNECT_TIMEOUT": "1", "GPUQ_COMMAND_TIMEOUT": "1"}
        async with anyio.create_task_group() as tg:
            result = []

            async def run():
                result.append(await anyio.to_thread.run_sync(lambda: gpuq("wait", str(job_id), env=env, timeout=30)))

            tg.start_soon(run)
            await wait_for(waiting)
            proxy.black_hole()
            await pool.execute("UPDATE gpuq.jobs SET status = 'done', result = '{\"ok\": 1}' WHERE id = $1", job_id)
    [res] = result
    assert res.returncode == 0 and json.loads(res.stdout) == {"ok": 1}, res.stderr


def test_kind_timeout_from_the_shell(dsn):
    env = {"DATABASE_URL": dsn}
    assert gpuq("kind-timeout", "render", "600", env=env).stdout.strip() == "render: default timeout 600 s"
    assert gpuq("kind-timeout", env=env).stdout.strip() == "render  600 s"
    assert gpuq("kind-timeout", "render", "none", env=env).stdout.strip() == "render: default timeout none"
    res = gpuq("kind-timeout", "render", "soon", env=env)
    assert res.returncode == 1 and "whole seconds or none" in res.stderr


def test_batch_policy_from_the_shell(dsn):
    env = {"DATABASE_URL": dsn}
    res = gpuq("batch", "embed", "--max-items", "64", "--max-wait-ms", "10", env=env)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "embed: at most 64 a batch, a partial one after 10 ms"
    assert '"event": "admin.batch"' in res.stderr and '"max_items": 64' in res.stderr  # the admin event
    assert gpuq("batch", "score", "--max-items", "8", "--max-cost", "4096", env=env).returncode == 0
    assert gpuq("batch", env=env).stdout.splitlines() == [
        "embed: at most 64 a batch, a partial one after 10 ms", "score: at most 8 a batch, a partial one at once, cost <= 4096"]
    assert gpuq("batch", "embed", "--max-items", "32", env=env).stdout.strip() == "embed: at most 32 a batch, a partial one at once"
    assert gpuq("batch", "embed", "none", env=env).stdout.strip() == "embed: not batched"
    assert gpuq("batch", env=env).stdout.splitlines() == ["score: at most 8 a batch, a partial one at once, cost <= 4096"]
    res = gpuq("batch", "embed", "--max-items", "0", env=env)  # the value rules: test_batching.py
    assert res.returncode == 1 and "max_items must be 1-4096" in res.stderr


@pytest.mark.parametrize(("argv", "says"), [
    (["batch", "embed"], "give either --max-items N or none"),
    (["batch", "embed", "none", "--max-items", "3"], "give either --max-items N or none"),
    (["batch", "--max-items", "3"], "give the KIND"),
])
def test_batch_refuses_a_half_command_before_touching_the_database(argv, says, capsys):
    from gpuq.cli import main

    assert main([*argv, "--database-url", "postgresql://127.0.0.1:1/unreachable"]) == 1  # CLIError
    assert says in capsys.readouterr().err


def test_limit_from_the_shell(dsn):
    env = {"DATABASE_URL": dsn}
    assert gpuq("limit", "kind", "render", "3", env=env).stdout.strip() == "kind render: at most 3 running"
    assert gpuq("limit", "key", "tenant-a", "1", env=env).returncode == 0
    assert gpuq("limit", env=env).stdout.splitlines() == ["key  tenant-a  0/1 running", "kind  render  0/3 running"]
    assert gpuq("limit", "kind", "render", "none", env=env).stdout.strip() == "kind render: no limit"
    res = gpuq("limit", "kind", "render", "many", env=env)
    assert res.returncode == 1 and "whole number of jobs or none" in res.stderr
    res = gpuq("limit", "kind", "bad kind", "2", env=env)
    assert res.returncode == 1 and "bad job kind" in res.stderr


def test_enqueue_with_placement_from_the_shell(dsn):
    env = {"DATABASE_URL": dsn}
    job_id = gpuq("enqueue", "train", "{}", "--gpus", "2", "--gpu-memory", "40000", "--labels", "gpu=h100,region=eu",
                  "--model", "llama-8b", "--concurrency-key", "tenant-a", env=env).stdout.strip()
    shown = json.loads(gpuq("show", job_id, env=env).stdout)
    assert (shown["gpus"], shown["gpu_memory_mb"], shown["labels"], shown["model"], shown["concurrency_key"]) == (
        2, 40000, ["gpu=h100", "region=eu"], "llama-8b", "tenant-a")
    res = gpuq("enqueue", "train", "{}", "--gpu-memory", "40000", env=env)
    assert res.returncode == 1 and "needs gpus of at least 1" in res.stderr


def test_wait_progress_prints_the_stored_progress_on_stderr(dsn):
    import asyncio

    import asyncpg

    from gpuq import queue
    from gpuq.protocol import ProgressUpdate

    env = {"DATABASE_URL": dsn}
    job_id = int(gpuq("enqueue", "embed", "{}", env=env).stdout)

    async def report():
        c = await asyncpg.connect(dsn)
        [leased] = (await queue.lease(c, ["embed"], 1, "a#1", 30)).jobs
        await queue.record_progress(c, [ProgressUpdate(job_id, leased.lease_token, 0.5, "half", {"s": 1})])
        await queue.record_checkpoints(c, [(job_id, leased.lease_token, '{"step": 5}')])
        await c.close()

    asyncio.run(report())
    res = gpuq("wait", str(job_id), "--progress", "--timeout", "0.5", env=env)
    progress_line, error = res.stderr.strip().splitlines()
    assert res.returncode == 1 and error == f"gpuq: error: job {job_id} did not end within 0.5 s"
    shown = json.loads(progress_line)
    assert (shown["fraction"], shown["message"], shown["data"], shown["attempt"]) == (0.5, "half", {"s": 1}, 1)
    shown = json.loads(gpuq("show", str(job_id), env=env).stdout)
    assert shown["progress"]["message"] == "half"
    assert (shown["checkpoint"], shown["checkpoint_attempt"]) == ({"step": 5}, 1) and shown["checkpoint_at"]
