"""Many websocket agents in one process (``python -m gpuq.bench.swarm``), for ``gpuq bench agents``.

Each agent is a ``gpuq.agent.Agent`` with its own connection, named
``swarm-<n>``; all share one event loop. SIGTERM stops them all gracefully.
"""

from __future__ import annotations

import argparse
import sys

import anyio

from gpuq.agent import Agent
from gpuq.agent.handlers import load_handler
from gpuq.runtime import run_service
from gpuq.signals import stop_on_signal


async def run(args: argparse.Namespace) -> None:
    handler = load_handler(args.handler)
    agents = [Agent(args.url, args.token, args.kinds.split(","), args.capacity, handler,
                    f"swarm-{args.first + i}", reconnect_min=0.5, reconnect_max=5.0)
              for i in range(args.count)]
    async with anyio.create_task_group() as tg:
        tg.start_soon(stop_on_signal, *(a.stop for a in agents))
        async with anyio.create_task_group() as inner:
            for a in agents:
                inner.start_soon(a.run)
                await anyio.sleep(0.002)  # spread the handshakes a little
        tg.cancel_scope.cancel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gpuq.bench.swarm")
    p.add_argument("--url", required=True)
    p.add_argument("--token", required=True)
    p.add_argument("--kinds", required=True)
    p.add_argument("--count", type=int, required=True)
    p.add_argument("--first", type=int, default=0)
    p.add_argument("--capacity", type=int, default=1)
    p.add_argument("--handler", default="gpuq.demo:noop")
    args = p.parse_args(argv)
    from gpuq import logs

    logs.configure(fmt="json", level="warning")
    run_service(run, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
