"""``gpuq tenant``: tenants' weights for fair share (set, removed, listed with usage and shares), and
the usage half-life. A change is an admin event on stderr."""

from __future__ import annotations

import argparse
from typing import Any

from gpuq import config
from gpuq.cli.database import on_db
from gpuq.cli.errors import CLIError
from gpuq.cli.output import admin_event, table

USAGE = "gpuq tenant set NAME --weight W | gpuq tenant set NAME none | gpuq tenant [--half-life SECONDS]"


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser("tenant", help="tenants' weights for fair share, across every server (a weight set turns "
                                      "it on); no arguments: each tenant's weight, usage (GPU-seconds) and share")
    t.add_argument("set", metavar="set", nargs="?", choices=("set",), help="set (or remove) a tenant's weight")
    t.add_argument("name", metavar="NAME", nargs="?", help="the tenant (default: the jobs that name none)")
    t.add_argument("remove", metavar="none", nargs="?", choices=("none",), help="none: remove the weight (back to 1)")
    t.add_argument("--weight", type=float, metavar="W", help="its weight, more than 0 (a tenant without one weighs 1)")
    t.add_argument("--half-life", type=float, metavar="SECONDS",
                   help="usage halves every SECONDS, on every server (default 3600)")
    config.add_flags(t, "tenant")
    t.set_defaults(func=cmd_tenant)


def cmd_tenant(args: argparse.Namespace) -> int:
    from gpuq import admin

    removing = args.remove == "none"
    if args.set is None and (args.name is not None or args.weight is not None):
        raise CLIError(USAGE)
    if args.set is not None and (args.name is None or removing == (args.weight is not None)):
        raise CLIError(USAGE)

    async def run(conn: Any) -> tuple[list[dict[str, Any]], float]:
        try:
            if args.set is not None:
                await admin.set_tenant(conn, args.name, None if removing else args.weight)
            if args.half_life is not None:
                await admin.set_half_life(conn, args.half_life)
        except ValueError as exc:
            raise CLIError(str(exc)) from None
        return [t.as_dict() for t in await admin.tenants(conn)], await admin.half_life(conn)

    tenants, half_life = on_db(args, run)
    if args.set is not None:
        admin_event("tenant", tenant=args.name, weight=None if removing else args.weight)
        print(f"{args.name}: " + ("weight removed (weighs 1)" if removing else f"weight {args.weight:g}"))
        return 0
    if args.half_life is not None:
        admin_event("tenant_half_life", seconds=args.half_life)
    print("\n".join(render(tenants, half_life)))
    return 0


def render(tenants: list[dict[str, Any]], half_life: float) -> list[str]:
    """The half-life, then each tenant (``Tenant.as_dict``), or that fair share is off."""
    lines = [f"usage half-life: {half_life:g} s"]
    if not tenants:
        return [*lines, "fair share off: no tenant has a weight (gpuq tenant set NAME --weight W)"]
    return [*lines, *tenant_table(tenants)]


def tenant_table(tenants: list[dict[str, Any]]) -> list[str]:
    """Each tenant as a row: weight, usage, share against its fair share, running and pending jobs."""
    rows: list[tuple[str, ...]] = [("tenant", "weight", "usage (GPU-s)", "share", "fair share", "running", "pending")]
    rows += [(t["tenant"], f"{t['weight']:g}" + ("" if t["weighted"] else " (default)"),
              f"{t['usage_gpu_seconds']:.1f}", f"{t['share']:.1%}", f"{t['fair_share']:.1%}", str(t["running"]),
              str(t["pending"])) for t in tenants]
    return table(rows, right={2, 3, 4, 5, 6})
