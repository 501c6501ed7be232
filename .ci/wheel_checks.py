"""The installed wheel at work, run by ``wheel_smoke.py`` with the fresh virtualenv's Python from a
directory outside the source tree: gpuq must come from that virtualenv's site-packages.

On a throwaway PostgreSQL cluster (``gpuq.devdb``, from the wheel): ``gpuq migrate`` applies every
shipped migration; ``gpuq serve`` answers ``/healthz``, serves the dashboard's login page, a static
file and, after logging in, the overview page (templates and static files found in the package);
a job enqueued with ``gpuq enqueue`` is run by ``gpuq agent`` (the demo handler) and ends ``done``.
Each command is the virtualenv's own ``gpuq`` script. Exits non-zero (an ``AssertionError``) on
any failure. Standard library and the installed gpuq only.
"""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from importlib import resources
from pathlib import Path

import gpuq
from gpuq.devdb import free_port, throwaway_cluster

BIN = Path(sys.executable).parent
GPUQ = str(BIN / "gpuq")
AGENT_TOKEN, UI_TOKEN = "wheel-agent-token", "wheel-ui-token"
DEADLINE = 60.0  # seconds any one step may take


def main() -> None:
    where = Path(gpuq.__file__).resolve()
    assert where.is_relative_to(Path(sys.prefix).resolve()), f"gpuq imported from {where}, not the virtualenv"
    print(f"  gpuq from {where.parent}")
    cluster = throwaway_cluster()
    dsn = cluster.ensure_started()
    env = {**os.environ, "DATABASE_URL": dsn, "GPUQ_LOG_LEVEL": "warning"}
    try:
        migrate(env)
        port = free_port()
        server = subprocess.Popen([GPUQ, "serve"], env={**env, "GPUQ_LISTEN": f"127.0.0.1:{port}",
                                                        "GPUQ_TOKENS": AGENT_TOKEN, "GPUQ_UI_ADMIN_TOKENS": UI_TOKEN})
        try:
            wait_healthy(port, server)
            dashboard(port)
            run_a_job(env, port)
        finally:
            stop(server, "gpuq serve")
    finally:
        cluster.destroy()


def migrate(env: dict[str, str]) -> None:
    shipped = sorted(p.name for p in resources.files("gpuq").joinpath("migrations").iterdir()
                     if p.name.endswith(".sql"))
    assert shipped, "no migrations shipped in the package"
    out = gpuq_cli(env, "migrate")
    assert out == f"applied {', '.join(shipped)}", f"gpuq migrate printed {out!r}; the package ships {shipped}"
    assert gpuq_cli(env, "migrate") == "up to date"
    print(f"  gpuq migrate: {len(shipped)} migrations applied, then up to date")


def wait_healthy(port: int, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + DEADLINE
    while True:
        assert server.poll() is None, f"gpuq serve exited {server.returncode}"
        try:
            if get(port, "/healthz")[0] == 200:
                print(f"  gpuq serve: /healthz 200 on port {port}")
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, "gpuq serve did not answer /healthz"
        time.sleep(0.1)


def dashboard(port: int) -> None:
    status, headers, _ = get(port, "/ui")
    assert status == 303 and headers.get("Location") == "/ui/login", f"/ui answered {status} {headers}"
    status, _, body = get(port, "/ui/login")
    assert status == 200 and b"<form" in body, f"/ui/login answered {status}: {body[:200]!r}"
    css = resources.files("gpuq.ui").joinpath("static", "gpuq.css").read_bytes()
    status, _, body = get(port, "/ui/static/gpuq.css")
    assert status == 200 and body == css, f"/ui/static/gpuq.css answered {status} ({len(body)} bytes)"
    origin = {"Origin": f"http://127.0.0.1:{port}", "Authorization": f"Bearer {UI_TOKEN}"}
    status, headers, _ = request(port, "POST", "/ui/login", origin)
    assert status == 204 and "Set-Cookie" in headers, f"logging in answered {status}"
    cookie = headers["Set-Cookie"].split(";", 1)[0]
    status, _, body = get(port, "/ui", {"Cookie": cookie})
    assert status == 200 and b"htmx" in body, f"/ui after logging in answered {status}: {body[:200]!r}"
    print("  dashboard: /ui/login, /ui/static/gpuq.css and /ui (logged in) served")


def run_a_job(env: dict[str, str], port: int) -> None:
    job_id = int(gpuq_cli(env, "enqueue", "demo", '{"seconds": 0}'))
    agent = subprocess.Popen([GPUQ, "agent", "--url", f"ws://127.0.0.1:{port}/agent", "--token", AGENT_TOKEN,
                              "--kinds", "demo", "--handler", "gpuq.demo:handle", "--devices", "none"], env=env)
    try:
        result = json.loads(gpuq_cli(env, "wait", str(job_id), "--timeout", str(DEADLINE)))
        assert result.get("ok") is True and result.get("job") == job_id, f"job {job_id} returned {result}"
        shown = json.loads(gpuq_cli(env, "show", str(job_id)))
        assert shown["status"] == "done", f"job {job_id} is {shown['status']}"
    finally:
        stop(agent, "gpuq agent")
    print(f"  gpuq agent ran job {job_id}: done, {result}")


def gpuq_cli(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([GPUQ, *args], env=env, capture_output=True, text=True, timeout=DEADLINE)
    assert done.returncode == 0, f"gpuq {' '.join(args)} exited {done.returncode}: {done.stderr[-2000:]}"
    return done.stdout.strip()


def stop(proc: subprocess.Popen[bytes], name: str) -> None:
    """SIGTERM: it must drain and exit 0."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        code = proc.wait(DEADLINE)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"{name} did not exit within {DEADLINE:.0f} s of SIGTERM") from None
    assert code == 0, f"{name} exited {code} on SIGTERM"


def get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    return request(port, "GET", path, headers or {})


def request(port: int, method: str, path: str, headers: dict[str, str]) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, headers=headers)
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


if __name__ == "__main__":
    main()
