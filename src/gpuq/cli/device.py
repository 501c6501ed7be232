"""``gpuq device``: the quarantine of bad GPUs (issue #33): list it, clear a device, quarantine one
by hand. A device is ``AGENT:INDEX``, as ``gpuq status --server`` and the dashboard show it. A
change is an admin event on stderr; every server honours it at once (a notification)."""

from __future__ import annotations

import argparse
from typing import Any

from gpuq import config
from gpuq.cli.database import on_db
from gpuq.cli.errors import EXIT_FAILURE, CLIError
from gpuq.cli.output import admin_event, table

USAGE = "gpuq device [list] | gpuq device clear AGENT[:INDEX] | gpuq device quarantine AGENT:INDEX [--reason TEXT]"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    d = sub.add_parser("device", help="quarantined GPUs (no new job goes there), across every server: list them, "
                                      "clear one (clear AGENT:INDEX, or AGENT: all of it), or quarantine one by hand")
    d.add_argument("action", metavar="list|clear|quarantine", nargs="?", default="list",
                   choices=("list", "clear", "quarantine"))
    d.add_argument("device", metavar="AGENT[:INDEX]", nargs="?", help="the agent's name and the device's index")
    d.add_argument("--reason", default="", help="quarantine: why (shown with it)")
    config.add_flags(d, "device")
    d.set_defaults(func=cmd_device)


def cmd_device(args: argparse.Namespace) -> int:
    from gpuq import quarantine

    if (args.action == "list") != (args.device is None):
        raise CLIError(USAGE)
    if args.action == "list":
        print("\n".join(render(on_db(args, quarantine.listing))))
        return 0
    try:
        agent, index = quarantine.parse_device(args.device)
    except ValueError as exc:
        raise CLIError(str(exc)) from None

    async def change(conn: Any) -> list[int]:
        try:
            if args.action == "clear":
                return await quarantine.clear(conn, agent, index)
            return await quarantine.quarantine(conn, agent, index, args.reason)
        except ValueError as exc:
            raise CLIError(str(exc)) from None

    changed = on_db(args, change)
    admin_event(f"device_{args.action}", agent=agent, device=index, changed=changed)
    if not changed:
        state = "not quarantined" if args.action == "clear" else "quarantined already"
        print(f"{args.device}: {state}")
        return EXIT_FAILURE if args.action == "clear" else 0
    done = "cleared: it takes new jobs again" if args.action == "clear" else "quarantined: it takes no new job"
    print("\n".join(f"{quarantine.device_name(agent, i)}: {done}" for i in changed))
    return 0


def render(devices: list[dict[str, Any]]) -> list[str]:
    """Each quarantined device with its reason, or that none is."""
    if not devices:
        return ["no device is quarantined"]
    rows: list[tuple[str, ...]] = [("device", "since", "faults", "reason")]
    rows += [(d["device"], d["since"][:19], str(d["faults"]), d["reason"]) for d in devices]
    return table(rows, right={2})
