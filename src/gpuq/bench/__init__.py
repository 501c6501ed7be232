"""``gpuq bench``: reproducible performance figures, each ending in one JSON line.

``register(parser)`` adds the benches as sub-commands of the ``gpuq bench``
parser; each sets ``bench=fn`` where ``fn(args) -> int`` runs synchronously.
"""

from __future__ import annotations

import argparse

from gpuq.bench import agents, chaos, fuzz, latency, lease_history, raw, soak, throughput


def register(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench_name", required=True, metavar="BENCH")
    lease_history.register(sub)
    raw.register(sub)
    throughput.register(sub)
    chaos.register(sub)
    soak.register(sub)
    fuzz.register(sub)
    latency.register(sub)
    agents.register(sub)


__all__ = ["register"]
