"""TLS: wss:// for agents and https:// for the endpoints, with a self-signed certificate."""

import json
import shutil
import ssl
import subprocess
import urllib.request

import anyio
import pytest

from gpuq.agent import Agent
from gpuq.config import ConfigError
from gpuq.harness import TOKEN, server_config
from gpuq.server import serve, ssl_context
from tests.helpers import sets

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")


@pytest.fixture
def cert(tmp_path):
    key, crt = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key),
                    "-out", str(crt), "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True)
    return str(crt), str(key)


async def test_agents_over_wss_and_status_over_https(dsn, pool, cert):
    crt, key = cert
    stop, ready, port = anyio.Event(), anyio.Event(), []
    client_ctx = ssl.create_default_context(cafile=crt)
    done = anyio.Event()

    async with anyio.create_task_group() as tg:
        tg.start_soon(lambda: serve(server_config(dsn), stop=stop, tls=ssl_context(crt, key),
                                    on_ready=lambda p: (port.append(p), ready.set())))
        with anyio.fail_after(10):
            await ready.wait()
        agent = Agent(f"wss://127.0.0.1:{port[0]}/agent", TOKEN, ["tls"], 1, sets(done),
                      "secure", ssl_context=client_ctx)
        tg.start_soon(agent.run)
        await pool.execute("INSERT INTO gpuq.jobs (kind) VALUES ('tls')")
        with anyio.fail_after(10):
            await done.wait()

        def https_status():
            request = urllib.request.Request(f"https://127.0.0.1:{port[0]}/status",
                                             headers={"Authorization": f"Bearer {TOKEN}"})
            with urllib.request.urlopen(request, context=client_ctx, timeout=5) as r:
                return json.load(r)

        status = await anyio.to_thread.run_sync(https_status)
        assert status["agents_connected"] == 1
        agent.stop()
        stop.set()


def test_tls_needs_both_files_and_readable_ones(tmp_path, cert):
    with pytest.raises(ConfigError, match="both"):
        ssl_context(cert[0], None)
    with pytest.raises(ConfigError, match="cannot load"):
        ssl_context(str(tmp_path / "missing.pem"), str(tmp_path / "missing.key"))
