"""The ``gpuq`` command: migrate, serve, sweep, agent, enqueue, status, jobs, show, wait, cancel, pause, resume,
retry, schedule, kind-timeout, limit, batch, tenant, device, dev, bench.

Each command (or small family of commands) is a module here that registers its own flags and
holds its handler; this module builds the parser from them, in ``COMMANDS`` order (the order
``gpuq --help`` lists them). Every failure an operator can cause ends in one ``gpuq: error: ...``
line and a non-zero exit, never a traceback (``errors``).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from gpuq import __version__, config, logs
from gpuq.cli import (
    admin,
    agent,
    batch,
    bench,
    dev,
    device,
    enqueue,
    jobs,
    schedule,
    services,
    status,
    tenant,
)
from gpuq.cli.errors import EXIT_FAILURE, EXIT_USAGE, CLIError, run_guarded

__all__ = ["COMMANDS", "EXIT_FAILURE", "EXIT_USAGE", "CLIError", "build_parser", "main"]

# The command modules, in the order of gpuq --help; each has register(subparsers).
COMMANDS = (services, agent, enqueue, status, jobs, admin, batch, tenant, device, schedule, dev, bench)
LOGGING_COMMANDS = set(config.LOGGED)
STDERR_LOG_COMMANDS = {"dev"}  # dev prints progress on stdout


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:  # its own parser, so nothing else loads the bench modules
        return run_guarded(bench.cmd_bench, argv[1:])
    return run_guarded(_command, build_parser().parse_args(argv))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gpuq", description="Event-driven GPU job queue on PostgreSQL.")
    p.add_argument("--version", action="version", version=f"gpuq {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.register(sub)
    return p


def _command(args: argparse.Namespace) -> int:
    if getattr(args, "log_format", None) is not None or args.command in LOGGING_COMMANDS:
        logs.configure(getattr(args, "log_format", None), getattr(args, "log_level", None),
                       stream=sys.stderr if args.command in STDERR_LOG_COMMANDS else sys.stdout)
    return int(args.func(args) or 0)
