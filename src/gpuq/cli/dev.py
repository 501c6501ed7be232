"""``gpuq dev``: everything on an embedded PostgreSQL under ``.gpuq/`` (``gpuq.devrun``)."""

from __future__ import annotations

import argparse

from gpuq import config


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser("dev", help="everything on an embedded PostgreSQL under .gpuq/: server, simulated GPU "
                       "agents, a producer of a mix of jobs, live progress")
    d.add_argument("--agents", type=int, default=3, help="demo agents (default 3)")
    d.add_argument("--capacity", type=int, default=4, help="capacity of each demo agent (default 4)")
    d.add_argument("--rate", type=float, default=20.0,
                   help="plain and batched jobs enqueued per second, besides the GPU jobs (default 20)")
    d.add_argument("--job-seconds", type=float, default=0.05, help="simulated time per plain job (default 0.05)")
    d.add_argument("--duration", type=float, help="stop after this many seconds (default: until Ctrl-C)")
    d.add_argument("--data-dir", default=".gpuq", help="where the embedded cluster lives (default .gpuq)")
    d.add_argument("--port", type=int, default=8765, help="server port (default 8765; 0 = any free port)")
    config.add_flags(d, "dev")
    d.set_defaults(func=cmd_dev)


def cmd_dev(args: argparse.Namespace) -> int:
    from gpuq.devrun import run_dev

    return run_dev(args)
