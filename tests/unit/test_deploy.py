"""deploy/: every file parses, agrees with the others and with the CLI and config contract.

No database, no Docker, no cluster: the files are parsed and checked for
structure, the commands they run are parsed by the real ``gpuq`` argument
parser, the settings they pass are loaded by the real ``ServerConfig``, and
the image's HEALTHCHECK one-liner runs against a stub HTTP server. If
``systemd-analyze`` is installed, it verifies the units too.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuq import config as gpuq_config
from gpuq.agent.handlers import load_handler
from gpuq.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
SYSTEMD = DEPLOY / "systemd"
K8S = DEPLOY / "k8s"

DEFAULT_DRAIN_SECONDS = gpuq_config.ServerConfig(database_url="x").drain_seconds
SERVE_PORT = 8765

# The configuration contract. Server settings also come from gpuq.config, so
# a setting added there must be documented here too (see the env example test).
SERVER_SETTINGS = {
    "DATABASE_URL", "GPUQ_LISTEN", "GPUQ_TOKENS", "GPUQ_LEASE_SECONDS", "GPUQ_HEARTBEAT_SECONDS",
    "GPUQ_POLL_SECONDS", "GPUQ_SWEEP_SECONDS", "GPUQ_RETENTION", "GPUQ_DRAIN_SECONDS",
    "GPUQ_MAX_PAYLOAD", "GPUQ_MAX_BATCH",
} | {s.env for s in gpuq_config.SETTINGS if s.users == "serve"}
AGENT_SETTINGS = {"GPUQ_URL", "GPUQ_TOKEN", "GPUQ_AGENT_NAME", "GPUQ_KINDS", "GPUQ_CAPACITY", "GPUQ_HANDLER",
                  "GPUQ_BATCH_HANDLER", "GPUQ_AGENT_MAX_BATCH", "GPUQ_CHECKPOINT_SECONDS"}
LOG_SETTINGS = {"GPUQ_LOG_FORMAT", "GPUQ_LOG_LEVEL", "GPUQ_EVENT_LOOP"}  # every long-running process
EXTRA_SETTINGS = {"GPUQ_TLS_CERT", "GPUQ_TLS_KEY", "GPUQ_MIGRATIONS", "GPUQ_DEMO_SECONDS"}

# What each process may be given (anything else is a typo or a misplaced secret).
SERVE_ENV = SERVER_SETTINGS | LOG_SETTINGS | {"GPUQ_TLS_CERT", "GPUQ_TLS_KEY", "GPUQ_MIGRATIONS"}
MIGRATE_ENV = {"DATABASE_URL", "GPUQ_MIGRATIONS"} | LOG_SETTINGS
AGENT_ENV = AGENT_SETTINGS | LOG_SETTINGS | {"GPUQ_DEMO_SECONDS"}
# Not gpuq settings, but fine to set for a Python service or a GPU handler.
GENERIC_ENV = {"PYTHONUNBUFFERED", "PYTHONDONTWRITEBYTECODE", "HOME", "XDG_CACHE_HOME", "HF_HOME",
               "CUDA_VISIBLE_DEVICES"}


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------


def seconds(text: str | int | float) -> float:
    """systemd/compose durations as used here: 45, 45s, 2min, 1m30s, 1h."""
    if isinstance(text, int | float):
        return float(text)
    units = {"": 1, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600}
    parts = re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text.strip())
    assert parts and "".join(f"{n}{u}" for n, u in parts) == text.replace(" ", ""), f"not a duration: {text!r}"
    return sum(float(n) * units[u] for n, u in parts)


def parse_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]} (keys may repeat)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = pending + raw.strip()
        pending = ""
        if not line or line[0] in "#;":
            continue
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if m := re.fullmatch(r"\[([A-Za-z]+)\]", line):
            current = sections.setdefault(m.group(1), [])
            continue
        key, sep, value = line.partition("=")
        assert sep and re.fullmatch(r"[A-Za-z][A-Za-z0-9]*", key.strip()), f"{path.name}:{lineno}: {raw!r}"
        assert current is not None, f"{path.name}:{lineno}: setting outside a section"
        current.append((key.strip(), value.strip()))
    assert not pending, f"{path.name}: ends in a line continuation"
    return sections


def unit_values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [v for k, v in unit.get(section, []) if k == key]


def unit_value(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> str:
    values = unit_values(unit, section, key)
    assert values, f"[{section}] has no {key}="
    return values[-1]


def parse_cli(argv: list[str]) -> Any:
    """The real gpuq parser: a deploy file running a command gpuq lacks fails here."""
    try:
        return build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse reports and exits
        pytest.fail(f"`gpuq {' '.join(argv)}` is not a valid gpuq command line (exit {exc.code})")


def resolve_interpolation(value: str) -> str:
    """Compose's ${VAR:-default} and ${VAR-default} → default (unset in the test)."""
    return re.sub(r"\$\{[A-Za-z_][A-Za-z0-9_]*:?-([^}]*)\}", r"\1", value)


def load_yaml_docs(path: Path) -> list[Any]:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    assert docs, f"{path.name} holds no YAML document"
    return docs


def load_server_config(env: dict[str, str]) -> gpuq_config.ServerConfig:
    """Values a deploy file gives `gpuq serve` must load (durations, ints, heartbeat < lease)."""
    try:
        return gpuq_config.ServerConfig.from_env(env)
    except gpuq_config.ConfigError as exc:
        pytest.fail(f"gpuq serve would refuse these settings: {exc}")


# --------------------------------------------------------------------------
# every file, every GPUQ_* name
# --------------------------------------------------------------------------


def test_the_deploy_tree_is_complete() -> None:
    for rel in ("README.md", "Dockerfile", "compose.yaml", "systemd/gpuq-serve.service",
                "systemd/gpuq-agent@.service", "systemd/gpuq.env.example", "k8s/migrate-job.yaml",
                "k8s/serve-deployment.yaml", "k8s/agent-deployment.yaml", "k8s/secret.example.yaml"):
        assert (DEPLOY / rel).is_file(), f"deploy/{rel} is missing"


@pytest.mark.parametrize("path", sorted([*DEPLOY.rglob("*.yaml"), *DEPLOY.rglob("*.yml")]),
                         ids=lambda p: str(p.relative_to(DEPLOY)))
def test_every_yaml_file_parses(path: Path) -> None:
    load_yaml_docs(path)


def test_every_gpuq_variable_in_deploy_is_one_the_code_reads() -> None:
    code = "\n".join(p.read_text() for p in (ROOT / "src" / "gpuq").rglob("*.py"))
    known = set(re.findall(r"\bGPUQ_[A-Z0-9_]+\b", code))
    for path in sorted(p for p in DEPLOY.rglob("*") if p.is_file()):
        for name in sorted(set(re.findall(r"\bGPUQ_[A-Z0-9_]+\b", path.read_text()))):
            assert name in known, f"deploy/{path.relative_to(DEPLOY)} names {name}, which gpuq never reads"


# --------------------------------------------------------------------------
# systemd
# --------------------------------------------------------------------------

UNITS = {"serve": SYSTEMD / "gpuq-serve.service", "agent": SYSTEMD / "gpuq-agent@.service"}


@pytest.mark.parametrize("role", sorted(UNITS))
def test_systemd_unit_structure_and_hardening(role: str) -> None:
    unit = parse_unit(UNITS[role])
    assert {"Unit", "Service", "Install"} <= set(unit), f"{UNITS[role].name}: sections {sorted(unit)}"
    assert unit_value(unit, "Install", "WantedBy") == "multi-user.target"

    argv = shlex.split(unit_value(unit, "Service", "ExecStart"))
    assert Path(argv[0]).is_absolute() and Path(argv[0]).name == "gpuq", argv
    assert argv[1] == role, f"ExecStart runs `gpuq {argv[1]}`, expected `gpuq {role}`"
    parse_cli(argv[1:])

    svc = dict(unit["Service"])  # last value wins, as in systemd
    assert svc.get("DynamicUser") == "yes" or svc.get("User") not in (None, "", "root", "0")
    assert svc["NoNewPrivileges"] == "yes"
    assert svc["ProtectSystem"] == "strict"
    assert svc["Restart"] == "on-failure"
    assert svc["KillSignal"] == "SIGTERM"
    assert svc.get("CapabilityBoundingSet", None) == "", "no capabilities are needed (port 8765)"
    assert seconds(svc["TimeoutStopSec"]) > DEFAULT_DRAIN_SECONDS

    env_files = [f.lstrip("-") for f in unit_values(unit, "Service", "EnvironmentFile")]
    assert "/etc/gpuq/gpuq.env" in env_files
    allowed = (SERVE_ENV if role == "serve" else AGENT_ENV) | GENERIC_ENV
    for assignment in unit_values(unit, "Service", "Environment"):
        for item in shlex.split(assignment):
            name = item.partition("=")[0]
            assert name in allowed, f"{UNITS[role].name} sets {name}, which `gpuq {role}` does not read"


def test_serve_unit_stops_after_the_drain_deadline() -> None:
    svc = dict(parse_unit(UNITS["serve"])["Service"])
    timeout = seconds(svc["TimeoutStopSec"])
    # "a bit above": the drain must finish, and a hung drain must not keep a restart waiting long.
    assert DEFAULT_DRAIN_SECONDS < timeout <= DEFAULT_DRAIN_SECONDS + 60
    assert svc.get("PrivateDevices") == "yes"


def test_agent_unit_is_a_template_that_keeps_the_gpu() -> None:
    unit = parse_unit(UNITS["agent"])
    svc = dict(unit["Service"])
    assert "%i" in " ".join(unit_values(unit, "Service", "EnvironmentFile")), "per-instance settings file"
    assert any(v.startswith("GPUQ_AGENT_NAME=") and "%i" in v for v in unit_values(unit, "Service", "Environment"))
    assert svc.get("PrivateDevices", "no") == "no", "the agent needs /dev/nvidia*"


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed")
def test_systemd_analyze_verify(tmp_path: Path) -> None:
    stub = tmp_path / "gpuq"
    stub.write_text("#!/bin/sh\nexit 0\n")
    stub.chmod(0o755)
    names = []
    for src, name in ((UNITS["serve"], "gpuq-serve.service"), (UNITS["agent"], "gpuq-agent@gpu0.service")):
        text = re.sub(r"^ExecStart(Pre)?=(\S*/)?gpuq\b", lambda m: f"ExecStart{m.group(1) or ''}={stub}",
                      src.read_text(), flags=re.M)
        (tmp_path / name).write_text(text)
        names.append(f"./{name}")
    proc = subprocess.run(["systemd-analyze", "verify", "--man=no", *names], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60)
    # verify exits 0 on unknown keys and bad values too; it only prints them.
    complaints = [line for line in (proc.stdout + proc.stderr).splitlines() if "gpuq" in line]
    assert proc.returncode == 0 and not complaints, proc.stdout + proc.stderr


def parse_env_example() -> tuple[list[str], dict[str, str]]:
    lines = (SYSTEMD / "gpuq.env.example").read_text().splitlines()
    active: dict[str, str] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = re.fullmatch(r"([A-Z_][A-Z0-9_]*)=(\S.*)", line)
        assert m, f"gpuq.env.example:{lineno}: not KEY=value as systemd EnvironmentFile reads it: {line!r}"
        active[m.group(1)] = m.group(2)
    return lines, active


SETTING_LINE = re.compile(r"^#?([A-Z_][A-Z0-9_]*)=(.*)$")


def test_env_example_documents_every_setting_with_a_comment() -> None:
    lines, _ = parse_env_example()
    found: dict[str, int] = {}
    for i, line in enumerate(lines):
        if m := SETTING_LINE.match(line):
            found.setdefault(m.group(1), i)
    expected = SERVER_SETTINGS | AGENT_SETTINGS | LOG_SETTINGS | EXTRA_SETTINGS
    missing = sorted(expected - set(found))
    assert not missing, f"document {missing} in deploy/systemd/gpuq.env.example"
    for name, i in found.items():
        block = []  # the lines above, up to a blank one
        j = i - 1
        while j >= 0 and lines[j].strip():
            block.append(lines[j])
            j -= 1
        assert any(b.startswith("#") and not SETTING_LINE.match(b) for b in block), \
            f"gpuq.env.example: {name} has no explanatory comment above it"


def test_env_example_values_load() -> None:
    lines, active = parse_env_example()
    assert {"DATABASE_URL", "GPUQ_TOKENS", "GPUQ_TOKEN"} <= set(active), "the required settings are set"
    every = {m.group(1): m.group(2) for line in lines if (m := SETTING_LINE.match(line))}
    # Defaults shown, uncommented, must be accepted as they are.
    config = load_server_config({k: v for k, v in every.items() if k in SERVER_SETTINGS})
    assert config.listen == ("127.0.0.1", SERVE_PORT)
    assert every["GPUQ_TOKEN"] in config.tokens
    assert every["GPUQ_URL"] == f"ws://127.0.0.1:{SERVE_PORT}/agent"
    parse_cli(["agent", "--kinds", every["GPUQ_KINDS"], "--capacity", every["GPUQ_CAPACITY"]])
    assert callable(load_handler(every["GPUQ_HANDLER"]))


# --------------------------------------------------------------------------
# Dockerfile
# --------------------------------------------------------------------------


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not buf):
            continue  # comments (also inside continuations) and blank lines
        buf += stripped
        if buf.endswith("\\"):
            buf = buf[:-1] + " "
            continue
        op, _, rest = buf.partition(" ")
        out.append((op.upper(), rest.strip()))
        buf = ""
    assert not buf, "Dockerfile ends in a line continuation"
    return out


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (op, _) in enumerate(instructions) if op == "FROM")
    return instructions[last_from:]


def docker_env(stage: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for op, rest in stage:
        if op == "ENV":
            for item in shlex.split(rest):
                key, sep, value = item.partition("=")
                assert sep, f"use ENV KEY=value, not {rest!r}"
                env[key] = value
    return env


def healthcheck_code() -> str:
    stage = final_stage(dockerfile_instructions(DEPLOY / "Dockerfile"))
    [rest] = [rest for op, rest in stage if op == "HEALTHCHECK"]
    cmd = json.loads(rest[rest.index("CMD") + 3:].strip())
    assert cmd[:2] == ["python", "-c"], cmd
    return str(cmd[2])


def test_dockerfile() -> None:
    instructions = dockerfile_instructions(DEPLOY / "Dockerfile")
    stage = final_stage(instructions)
    ops = {op: rest for op, rest in stage}
    assert ops["FROM"].split()[0] == "python:3.11-slim"
    assert json.loads(ops["ENTRYPOINT"]) == ["gpuq"]
    cmd = json.loads(ops["CMD"])
    assert cmd == ["serve"]
    parse_cli(cmd)
    assert str(SERVE_PORT) in ops["EXPOSE"].split()
    user = ops["USER"].split(":")[0]
    assert user not in ("root", "0"), "the image must not run as root"
    assert "/healthz" in ops["HEALTHCHECK"]
    compile(healthcheck_code(), "HEALTHCHECK", "exec")

    env = docker_env(stage)
    assert env["GPUQ_LISTEN"] == f"0.0.0.0:{SERVE_PORT}"
    assert set(env) <= SERVE_ENV | AGENT_ENV | GENERIC_ENV | {"PIP_NO_CACHE_DIR", "PIP_DISABLE_PIP_VERSION_CHECK"}
    # The SQL files are not in the wheel: they are copied where GPUQ_MIGRATIONS says.
    copies = [shlex.split(rest) for op, rest in instructions if op == "COPY"]
    dests = {args[-1].rstrip("/"): args[:-1] for args in copies if not any(a.startswith("--from") for a in args)}
    assert dests.get(env["GPUQ_MIGRATIONS"]) == ["migrations/"], dests

    # Every file the build copies from the context exists and survives the ignore file.
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().splitlines()
    kept = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    for args in copies:
        if any(a.startswith("--") for a in args):
            continue
        for src in args[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
            assert src.rstrip("/") in kept, f"COPY {src}: excluded by Dockerfile.dockerignore"


class _Health(BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(self.status if self.path == "/healthz" else 404)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize(("status", "healthy"), [(200, True), (503, False)])
def test_dockerfile_healthcheck_follows_healthz(status: int, healthy: bool) -> None:
    handler = type("H", (_Health,), {"status": status})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        port = server.server_address[1]
        proc = subprocess.run([sys.executable, "-c", healthcheck_code()], capture_output=True, timeout=30,
                              env={"GPUQ_LISTEN": f"0.0.0.0:{port}", "PATH": "/usr/bin:/bin"})
    finally:
        server.shutdown()
        server.server_close()
    assert (proc.returncode == 0) is healthy, proc.stderr.decode()


# --------------------------------------------------------------------------
# compose
# --------------------------------------------------------------------------


def compose() -> dict[str, Any]:
    [doc] = load_yaml_docs(DEPLOY / "compose.yaml")
    return doc  # type: ignore[no-any-return]


def compose_env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    assert isinstance(env, dict), "use the mapping form of environment:"
    return {k: resolve_interpolation(str(v)) for k, v in env.items()}


def test_compose_services_and_startup_order() -> None:
    services = compose()["services"]
    assert set(services) == {"postgres", "migrate", "serve", "agent"}

    pg = services["postgres"]
    assert str(pg["image"]).startswith("postgres:16")
    assert pg["healthcheck"]["test"], "postgres needs a healthcheck for service_healthy"

    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["migrate"].get("restart") in (None, "no"), "a one-shot must not restart"
    assert services["serve"]["depends_on"]["migrate"]["condition"] == "service_completed_successfully"
    assert "serve" in services["agent"]["depends_on"]

    for name in ("migrate", "serve", "agent"):
        svc = services[name]
        assert svc["command"][0] == name, f"{name}: command {svc['command']}"
        parse_cli([str(a) for a in svc["command"]])
        build = svc["build"]
        assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == (DEPLOY / "Dockerfile").resolve()
    assert len({services[n]["image"] for n in ("migrate", "serve", "agent")}) == 1, "one image"


def test_compose_settings_match_the_contract() -> None:
    services = compose()["services"]
    pg_env = compose_env(services["postgres"])
    migrate, serve, agent = (compose_env(services[n]) for n in ("migrate", "serve", "agent"))
    assert set(migrate) <= MIGRATE_ENV, set(migrate) - MIGRATE_ENV
    assert set(serve) <= SERVE_ENV, set(serve) - SERVE_ENV
    assert set(agent) <= AGENT_ENV, set(agent) - AGENT_ENV

    dsn = f"postgresql://{pg_env['POSTGRES_USER']}:{pg_env['POSTGRES_PASSWORD']}@postgres:5432/{pg_env['POSTGRES_DB']}"
    assert migrate["DATABASE_URL"] == serve["DATABASE_URL"] == dsn

    config = load_server_config(serve)
    assert config.listen == ("0.0.0.0", SERVE_PORT)  # noqa: S104 (a container)
    assert seconds(services["serve"]["stop_grace_period"]) > config.drain_seconds

    assert agent["GPUQ_URL"] == f"ws://serve:{SERVE_PORT}/agent"
    assert agent["GPUQ_TOKEN"] in config.tokens, "the agent's token must be one serve accepts"
    assert agent["GPUQ_HANDLER"] == "gpuq.demo:handle"
    assert callable(load_handler(agent["GPUQ_HANDLER"]))
    parse_cli(["agent", "--kinds", agent["GPUQ_KINDS"], "--capacity", agent["GPUQ_CAPACITY"]])
    assert services["migrate"]["healthcheck"] == {"disable": True}
    assert services["agent"]["healthcheck"] == {"disable": True}


# --------------------------------------------------------------------------
# Kubernetes
# --------------------------------------------------------------------------


def k8s_docs(name: str) -> list[dict[str, Any]]:
    return load_yaml_docs(K8S / name)


def only(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    return workload["spec"]["template"]["spec"]  # type: ignore[no-any-return]


def container(workload: dict[str, Any]) -> dict[str, Any]:
    [c] = pod_spec(workload)["containers"]
    return c  # type: ignore[no-any-return]


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def plain_env(c: dict[str, Any], secret_placeholders: dict[str, str]) -> dict[str, str]:
    out = {}
    for name, e in env_of(c).items():
        if "value" in e:
            out[name] = str(e["value"])
        elif ref := e.get("valueFrom", {}).get("secretKeyRef"):
            out[name] = secret_placeholders[ref["key"]]
    return out


def secret() -> dict[str, Any]:
    return only(k8s_docs("secret.example.yaml"), "Secret")


def secret_ref(c: dict[str, Any], name: str) -> dict[str, Any]:
    ref = env_of(c)[name].get("valueFrom", {}).get("secretKeyRef")
    assert ref, f"{name} must come from the Secret, not a literal"
    assert ref["name"] == secret()["metadata"]["name"]
    assert ref["key"] in secret()["stringData"], f"the Secret example has no key {ref['key']}"
    return ref  # type: ignore[no-any-return]


@pytest.mark.parametrize("path", sorted(K8S.glob("*.yaml")), ids=lambda p: p.name)
def test_k8s_documents_are_named_objects(path: Path) -> None:
    for doc in load_yaml_docs(path):
        assert isinstance(doc, dict) and doc.get("apiVersion") and doc.get("kind"), path.name
        assert doc.get("metadata", {}).get("name"), f"{path.name}: a {doc['kind']} without metadata.name"
        if doc["kind"] in ("Deployment", "Job"):
            spec = pod_spec(doc)
            assert spec["securityContext"]["runAsNonRoot"] is True
            labels = doc["spec"]["template"]["metadata"]["labels"]
            if doc["kind"] == "Deployment":
                assert doc["spec"]["selector"]["matchLabels"].items() <= labels.items()
            for c in spec["containers"]:
                assert c["securityContext"]["allowPrivilegeEscalation"] is False
                parse_cli([str(a) for a in c["args"]])


def test_k8s_migrate_job() -> None:
    job = only(k8s_docs("migrate-job.yaml"), "Job")
    c = container(job)
    assert c["args"] == ["migrate"]
    assert pod_spec(job)["restartPolicy"] in ("Never", "OnFailure")
    secret_ref(c, "DATABASE_URL")
    assert set(env_of(c)) <= MIGRATE_ENV


def test_k8s_serve_deployment_and_service() -> None:
    docs = k8s_docs("serve-deployment.yaml")
    deployment, service = only(docs, "Deployment"), only(docs, "Service")
    c = container(deployment)
    assert c["args"] == ["serve"]
    ports = {p.get("name"): p["containerPort"] for p in c["ports"]}
    assert SERVE_PORT in ports.values()

    for probe in ("readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/healthz", f"{probe} path"
        assert ports.get(get["port"], get["port"]) == SERVE_PORT, f"{probe} port"

    secret_ref(c, "DATABASE_URL")
    secret_ref(c, "GPUQ_TOKENS")
    assert set(env_of(c)) <= SERVE_ENV, set(env_of(c)) - SERVE_ENV
    config = load_server_config(plain_env(c, secret()["stringData"]))
    assert config.listen == ("0.0.0.0", SERVE_PORT)  # noqa: S104 (a pod)
    assert pod_spec(deployment)["terminationGracePeriodSeconds"] > config.drain_seconds

    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items(), "the Service selects the serve pods"
    [port] = service["spec"]["ports"]
    assert ports.get(port["targetPort"], port["targetPort"]) == SERVE_PORT
    assert service["spec"].get("sessionAffinity", "None") == "None", "sticky sessions are not needed"


def test_k8s_agent_deployment() -> None:
    agent = only(k8s_docs("agent-deployment.yaml"), "Deployment")
    serve_service = only(k8s_docs("serve-deployment.yaml"), "Service")
    c = container(agent)
    assert c["args"] == ["agent"]
    assert int(c["resources"]["limits"]["nvidia.com/gpu"]) == 1
    env = env_of(c)
    assert set(env) <= AGENT_ENV | GENERIC_ENV, set(env) - AGENT_ENV - GENERIC_ENV
    assert "DATABASE_URL" not in env, "agents never connect to PostgreSQL"
    [port] = serve_service["spec"]["ports"]
    assert env["GPUQ_URL"]["value"] == f"ws://{serve_service['metadata']['name']}:{port['port']}/agent"
    secret_ref(c, "GPUQ_TOKEN")
    stringdata = secret()["stringData"]
    assert stringdata["GPUQ_TOKEN"] in gpuq_config.parse_tokens(stringdata["GPUQ_TOKENS"])
    parse_cli(["agent", "--kinds", env["GPUQ_KINDS"]["value"], "--capacity", env["GPUQ_CAPACITY"]["value"]])
    assert callable(load_handler(env["GPUQ_HANDLER"]["value"]))


# --------------------------------------------------------------------------
# README
# --------------------------------------------------------------------------


def test_readme_covers_operations() -> None:
    text = (DEPLOY / "README.md").read_text()
    for needle in ("max_connections", "autovacuum_vacuum_scale_factor", "ALTER TABLE gpuq.jobs",
                   "synchronous_commit", "NOTIFY", "SKIP LOCKED", "Sticky sessions", "gpuq migrate",
                   "systemd-analyze", "docker compose", "kubectl"):
        assert needle in text, f"deploy/README.md does not mention {needle}"
    # Every deploy file it describes exists.
    for rel in re.findall(r"`((?:systemd|k8s)/[\w@.-]+|Dockerfile|compose\.yaml)`", text):
        assert (DEPLOY / rel).exists(), f"deploy/README.md mentions deploy/{rel}, which does not exist"
