"""``gpuq bench``: reproducible performance figures, each ending in one JSON line.

The CLI hands ``gpuq bench ...`` to ``main(argv)`` without importing any bench
module first: ``gpuq --help`` and ``gpuq agent`` load none of them. ``register``
adds every bench as a sub-command; each sets ``bench=fn``, ``fn(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

# Bench name -> module; the order of ``gpuq bench --help``.
MODULES = ("lease_history", "raw", "throughput", "chaos", "soak", "fuzz", "latency", "agents", "snapshot", "producers",
           "control", "placement", "busy", "failover", "batching", "fairness", "preempt")


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_name", required=True, metavar="BENCH")
    for name in MODULES:
        importlib.import_module(f"gpuq.bench.{name}").register(sub)


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="gpuq bench", description="Benchmarks (see docs/benchmarks.md); "
                                     "each prints a table and, last, one JSON line.")
    register(parser)
    args = parser.parse_args(argv)
    return int(args.bench(args))


__all__ = ["MODULES", "main", "register"]
