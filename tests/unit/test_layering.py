"""What each entry point loads, checked in a fresh interpreter.

An agent on a GPU box needs only websockets: ``import gpuq.agent`` must not
load asyncpg or the SQL side, nor ``import gpuq.testing`` (handler tests with no
database). ``gpuq --help`` and ``gpuq agent`` must not load the bench modules
(3,000 lines and their dependencies).
"""

import json
import subprocess
import sys

DATABASE_SIDE = ("asyncpg", "gpuq.db", "gpuq.queue", "gpuq.admin", "gpuq.wakeups", "gpuq.sql", "gpuq.producer",
                 "gpuq.dispatcher")


def loaded_after(code: str) -> set[str]:
    script = f"import sys, json\n{code}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_import_gpuq_agent_loads_nothing_of_the_database_side():
    mods = loaded_after("import gpuq.agent")
    assert "gpuq.agent" in mods and "websockets" in mods
    assert not [m for m in mods if m.startswith(DATABASE_SIDE)]


def test_import_gpuq_testing_loads_nothing_of_the_database_side():
    mods = loaded_after("import gpuq.testing")
    assert "gpuq.testing" in mods and "gpuq.agent" in mods
    assert not [m for m in mods if m.startswith(DATABASE_SIDE)]


def test_the_producer_api_still_loads_on_first_use():
    mods = loaded_after("import gpuq\nassert callable(gpuq.enqueue) and gpuq.NewJob('k').kind == 'k'")
    assert "gpuq.producer" in mods and "asyncpg" in mods


def test_gpuq_help_and_gpuq_agent_load_no_bench_module():
    for argv in (["--help"], ["agent", "--help"]):
        mods = loaded_after(f"from gpuq import cli\ntry:\n    cli.main({argv!r})\nexcept SystemExit:\n    pass")
        assert "gpuq.cli" in mods
        assert not [m for m in mods if m.startswith("gpuq.bench")], argv


def test_gpuq_bench_help_lists_every_bench():
    from gpuq import bench

    out = subprocess.run([sys.executable, "-m", "gpuq.cli", "bench", "--help"], capture_output=True,
                         text=True, check=True).stdout
    for name in bench.MODULES:
        assert name.replace("_", "-") in out
