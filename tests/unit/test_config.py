"""The settings table: the one source of flags, defaults, the README table and the deploy docs."""

import re
from pathlib import Path

import pytest

from gpuq import config
from gpuq.agent import process
from gpuq.cli import build_parser
from gpuq.config import SETTINGS, ConfigError, ServerConfig

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "gpuq"
DEV_ONLY = {"GPUQ_PG_BINDIR"}  # not a deployment setting


def test_the_readme_table_is_the_generated_one():
    text = (ROOT / "README.md").read_text()
    table = text.split("<!-- settings:start -->\n", 1)[1].split("\n<!-- settings:end -->", 1)[0]
    assert table == config.markdown_table(), "regenerate it: python -m gpuq.config"


def test_every_variable_the_code_reads_is_a_setting_and_every_setting_is_read():
    code = {p: p.read_text() for p in SRC.rglob("*.py") if "bench" not in p.parts}
    named = {n for text in code.values() for n in re.findall(r"\bGPUQ_[A-Z0-9_]+\b", text)}
    named -= {process.RESUME_FROM_ENV, process.CHECKPOINT_FD_ENV}  # what run_process gives a program: not settings
    envs = {s.env for s in SETTINGS}
    assert named <= envs, f"read outside the table: {sorted(named - envs)}"
    outside = "\n".join(text for path, text in code.items() if path.name != "config.py")
    for s in SETTINGS:
        read = (f'"{s.name}"' in outside or f"config.{s.name}" in outside
                or s.name in ServerConfig.__dataclass_fields__)
        assert read, f"{s.env} is in the table but nothing reads {s.name!r}"


@pytest.mark.parametrize("command", ["migrate", "serve", "sweep", "agent", "enqueue", "status", "dev"])
def test_each_command_has_exactly_the_flags_the_table_gives_it(command):
    sub = build_parser()._subparsers._group_actions[0].choices[command]  # noqa: SLF001
    help_text = sub.format_help()
    for s in SETTINGS:
        if flag := s.flags.get(command):
            assert flag in help_text and s.env in help_text, (command, s.env)


def test_a_flag_beats_the_environment_which_beats_the_default():
    env = {"DATABASE_URL": "postgresql://x/y", "GPUQ_LEASE_SECONDS": "2m"}
    assert ServerConfig.from_env({"DATABASE_URL": "postgresql://x/y"}).lease_seconds == 60
    assert ServerConfig.from_env(env).lease_seconds == 120
    assert ServerConfig.from_env(env, flags={"lease_seconds": "90s"}).lease_seconds == 90
    args = build_parser().parse_args(["serve", "--lease-seconds", "45", "--listen", ":9000"])
    cfg = ServerConfig.from_env(env, flags=config.flag_values(args, "serve"))
    assert (cfg.lease_seconds, cfg.listen) == (45, ("0.0.0.0", 9000))  # noqa: S104


@pytest.mark.parametrize("env, name", [
    ({"GPUQ_LEASE_SECONDS": "soon"}, "GPUQ_LEASE_SECONDS"),
    ({"GPUQ_MAX_BATCH": "many"}, "GPUQ_MAX_BATCH"),
    ({"GPUQ_LISTEN": "nowhere"}, "GPUQ_LISTEN"),
    ({"GPUQ_LOG_FORMAT": "xml"}, "GPUQ_LOG_FORMAT"),
])
def test_a_bad_value_names_its_setting(env, name):
    with pytest.raises(ConfigError, match=name):
        for s in SETTINGS:
            config.get(s.name, env)


def test_the_deploy_readme_lists_every_setting_with_its_default():
    rows = [line for line in (ROOT / "deploy" / "README.md").read_text().splitlines() if line.startswith("| `")]
    for s in SETTINGS:
        if s.env in DEV_ONLY:
            continue
        [row] = [r for r in rows if f"`{s.env}`" in r.split("|")[1]]
        first = s.shown_default.strip("`").split()[0]
        assert first in row, f"deploy/README.md: {s.env} should show its default {first!r}"


def test_the_env_example_shows_the_real_defaults():
    text = (ROOT / "deploy" / "systemd" / "gpuq.env.example").read_text()
    commented = dict(re.findall(r"^#([A-Z_][A-Z0-9_]*)=(.*)$", text, re.MULTILINE))
    for s in SETTINGS:
        if s.env in commented and s.default is not None:
            assert config.get(s.name, {s.env: commented[s.env]}) == s.default, s.env
