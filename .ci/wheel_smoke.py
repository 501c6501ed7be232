#!/usr/bin/env python3
"""A wheel that works: build gpuq's sdist and wheel, install the wheel into a fresh virtualenv, and
run it from there (``make wheel-check``; ``.ci/run`` runs it before ``make test``).

1. A copy of the work tree (what git tracks or would add, so no stale ``build/`` or ``*.egg-info``
   can fill a gap), and ``python -m build`` on it (``build`` is installed into a throwaway virtualenv when this Python lacks
   it) makes the sdist, then the wheel from the sdist, so both must hold what gpuq needs at run
   time: the migrations, the named queries, the dashboard's templates and static files.
2. The wheel, not editable, goes into a fresh virtualenv in a temporary directory (its
   dependencies from the package index), and ``wheel_checks.py`` runs with that virtualenv's
   Python from that directory: ``gpuq migrate``, ``gpuq serve`` (``/healthz``, the dashboard's
   login page, a static file, a page after logging in) and an agent that runs a job to ``done``,
   all on a throwaway PostgreSQL cluster. Nothing can be imported from ``src/``.

Exits non-zero on any failure. Standard library only. ``--keep`` keeps the temporary directory.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "gpuq"
# What the package reads at run time besides its modules: every such file must be in the wheel.
DATA = ("migrations/*.sql", "sql/*.sql", "bench/*.sql", "ui/templates/*.html", "ui/static/*")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep", action="store_true", help="keep the temporary directory (printed)")
    args = parser.parse_args()
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix="gpuq-wheel-"))
    tmp.chmod(0o755)  # the embedded PostgreSQL may run as another user (root cannot run it)
    try:
        wheel = build(snapshot(tmp / "src"), tmp / "dist")
        check_contents(wheel)
        python = install(wheel, tmp / "venv")
        step(f"run the checks from {tmp} with {python}")
        checks = tmp / "wheel_checks.py"
        shutil.copy(ROOT / ".ci" / "wheel_checks.py", checks)
        run([str(python), str(checks)], cwd=tmp, env=clean_env())
    except subprocess.CalledProcessError as exc:
        print(f"wheel smoke test FAILED: {' '.join(map(str, exc.cmd))} exited {exc.returncode}", file=sys.stderr)
        return 1
    except AssertionError as exc:
        print(f"wheel smoke test FAILED: {exc}", file=sys.stderr)
        return 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"wheel smoke test passed in {time.monotonic() - started:.0f} s")
    return 0


def snapshot(dest: Path) -> Path:
    """A copy of the files git tracks or would add (the work tree as it is, without what it
    ignores): a stale ``build/`` or ``*.egg-info`` would hide a file missing from the package data."""
    step(f"copy the work tree to {dest}")
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        src, dst = ROOT / name, dest / name
        if not src.exists() and not src.is_symlink():
            continue  # deleted in the work tree, not yet in the index
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))  # src/gpuq/migrations -> ../../migrations, as committed
        else:
            shutil.copy2(src, dst)
    return dest


def build(source: Path, outdir: Path) -> Path:
    """The sdist, then the wheel built from it; the wheel's path."""
    builder = sys.executable
    if subprocess.run([builder, "-c", "import build"], capture_output=True).returncode != 0:
        step("install build into a throwaway virtualenv")
        builder = str(make_venv(outdir.parent / "build-venv"))
        run([builder, "-m", "pip", "install", "--quiet", "build"])
    step("build the sdist, and the wheel from it")
    run([builder, "-m", "build", "--outdir", str(outdir), str(source)], quiet=True)
    [sdist] = outdir.glob("gpuq-*.tar.gz")
    [wheel] = outdir.glob("gpuq-*.whl")
    print(f"  {sdist.name} ({sdist.stat().st_size // 1024} KiB), {wheel.name} ({wheel.stat().st_size // 1024} KiB)")
    return wheel


def check_contents(wheel: Path) -> None:
    """Every data file the source tree has is in the wheel, under gpuq/."""
    step("check the wheel holds the migrations, the queries, the templates and static files")
    names = set(zipfile.ZipFile(wheel).namelist())
    wanted = {f"gpuq/{p.relative_to(PACKAGE).as_posix()}" for pattern in DATA for p in PACKAGE.glob(pattern)}
    assert wanted, f"no data files found under {PACKAGE}"
    missing = sorted(wanted - names)
    assert not missing, f"the wheel lacks {len(missing)} file(s): {', '.join(missing[:10])}"
    print(f"  {len(wanted)} data files present")


def install(wheel: Path, venv: Path) -> Path:
    """A fresh virtualenv with the wheel (not editable) and its dependencies; its Python."""
    step("install the wheel into a fresh virtualenv")
    python = make_venv(venv)
    run([str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", str(wheel)],
        env=clean_env())
    return python


def make_venv(path: Path) -> Path:
    run([sys.executable, "-m", "venv", str(path)])
    return path / "bin" / "python"


def clean_env() -> dict[str, str]:
    """This environment without what could import gpuq from elsewhere, or point it at a database."""
    drop = ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "DATABASE_URL")
    return {k: v for k, v in os.environ.items() if k not in drop and not k.startswith("GPUQ_")}


def run(argv: list[str], cwd: Path | None = None, env: dict[str, str] | None = None, quiet: bool = False) -> None:
    """Run ``argv``, failing on a non-zero exit; ``quiet``: its output only when it fails."""
    if not quiet:
        subprocess.run(argv, cwd=cwd, env=env, check=True)
        return
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout[-4000:], done.stderr[-4000:], sep="\n", file=sys.stderr)
        raise subprocess.CalledProcessError(done.returncode, argv)


def step(what: str) -> None:
    print(f"wheel smoke: {what}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
