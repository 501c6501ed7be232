"""``gpuq bench``: the benchmarks, parsed by ``gpuq.bench.main`` itself, so that no other command
loads the bench modules; this parser lists it for ``gpuq --help`` only."""

from __future__ import annotations

import argparse

from gpuq.cli.errors import CLIError


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    # Parsed by gpuq.bench.main (see gpuq.cli.main); listed here for --help only.
    sub.add_parser("bench", help="benchmarks: `gpuq bench --help` lists them (see docs/benchmarks.md)",
                   add_help=False)


def cmd_bench(argv: list[str]) -> int:
    try:
        from gpuq import bench
    except ImportError as exc:  # an install without the bench extra
        raise CLIError(f"benchmarks unavailable: {exc} (pip install 'gpuq[bench]')") from None
    return bench.main(argv)
