"""``gpuq agent``: run an agent with a handler named ``module:function``, configured from flags
and the environment. The agent library itself is ``gpuq.agent``."""

from __future__ import annotations

import argparse

from gpuq import config
from gpuq.cli.errors import CLIError
from gpuq.runtime import run_service


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    a = sub.add_parser("agent", help="run an agent that executes jobs with a handler")
    config.add_flags(a, "agent")
    a.add_argument("--ca-file", help="CA bundle to verify a wss:// server")
    a.set_defaults(func=cmd_agent)


def cmd_agent(args: argparse.Namespace) -> int:
    from gpuq.agent import Agent, load_handler
    from gpuq.gpus import parse_devices
    from gpuq.protocol import ProtocolError

    token, kinds = config.get("token", flag=args.token), config.get("kinds", flag=args.kinds)
    if not token:
        raise CLIError("no token: set GPUQ_TOKEN or --token")
    if not kinds:
        raise CLIError("no kinds: set GPUQ_KINDS or --kinds (comma-separated)")
    batch_spec = config.get("batch_handler", flag=args.batch_handler)
    batch_handler = load_handler(batch_spec) if batch_spec else None
    # A batch handler alone takes single jobs too; a --handler given (or set) beside it takes them.
    plain = config.given("handler", flag=args.handler) or batch_handler is None
    handler = load_handler(config.get("handler", flag=args.handler)) if plain else None
    ctx = None
    if args.ca_file:
        import ssl

        ctx = ssl.create_default_context(cafile=args.ca_file)
    try:
        devices = parse_devices(config.get("devices", flag=args.devices))
    except ValueError as exc:
        raise CLIError(f"--devices: {exc}") from None
    try:
        agent = Agent(config.get("url", flag=args.url), token, kinds, config.get("capacity", flag=args.capacity),
                      handler, config.get("agent_name", flag=args.agent_name), ssl_context=ctx, devices=devices,
                      labels=config.get("labels", flag=args.labels), models=config.get("models", flag=args.models),
                      prefetch=config.get("prefetch", flag=args.prefetch),
                      drain_seconds=config.get("agent_drain_seconds", flag=args.agent_drain_seconds),
                      interruption_notice=config.get("interruption_notice", flag=args.interruption_notice),
                      batch_handler=batch_handler,
                      max_batch=config.get("agent_max_batch", flag=args.agent_max_batch),
                      checkpoint_seconds=config.get("checkpoint_seconds", flag=args.checkpoint_seconds))
    except ProtocolError as exc:
        raise CLIError(exc.message) from None
    except ValueError as exc:  # handler and batch handler of different kinds (async, sync)
        raise CLIError(str(exc)) from None
    run_service(agent.run_until_signal)
    return 0
