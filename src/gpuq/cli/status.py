"""``gpuq status``: live job counts per kind and state, tenants' usage and shares while fair share
is on, and with ``--server`` the fleet a server's ``/status`` reports, as a table or JSON."""

from __future__ import annotations

import argparse
import json
from typing import Any

from gpuq import config
from gpuq.cli.database import on_db
from gpuq.cli.errors import CLIError
from gpuq.cli.output import table
from gpuq.cli.tenant import tenant_table


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    t = sub.add_parser("status", help="live job counts per kind and state (never scans history)")
    config.add_flags(t, "status")
    t.add_argument("--json", action="store_true", help="print JSON instead of a table")
    t.add_argument("--server", help="also show connected agents, from a server's /status (http://host:port)")
    t.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from gpuq import admin, quarantine

    async def read(conn: Any) -> dict[str, Any]:
        body = (await admin.status_counts(conn)).as_dict()
        body["tenants"] = [t.as_dict() for t in await admin.tenants(conn)]  # [] while fair share is off
        body["quarantined"] = await quarantine.listing(conn)
        return body

    body = on_db(args, read)
    if args.server:
        body["server"] = _fetch_server_status(args.server, config.get("token", flag=args.token))
    if args.json:
        print(json.dumps(body, indent=2, default=str))
    else:
        print(render_status(body))
    return 0


def _fetch_server_status(base: str, token: str | None) -> dict[str, Any]:
    """A server's ``/status``, read with ``token`` (an agent's or a dashboard's: GPUQ_TOKEN, --token)."""
    import urllib.error
    import urllib.request

    url = base.rstrip("/") + "/status"
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:  # noqa: S310 - operator-given http(s) URL
            return dict(json.load(resp))
    except urllib.error.HTTPError as exc:
        hint = ": give a token (GPUQ_TOKEN or --token)" if exc.code == 401 else ""
        raise CLIError(f"cannot read {url}: HTTP {exc.code}{hint}") from None
    except (OSError, ValueError) as exc:
        raise CLIError(f"cannot read {url}: {exc}") from None


def render_status(body: dict[str, Any]) -> str:
    live = body["live"]
    kinds = sorted({k for by_kind in live.values() for k in by_kind})
    rows: list[tuple[str, ...]] = [("kind", "pending", "leased", "scheduled")]
    rows += [(k, *(str(live[s].get(k, 0)) for s in ("pending", "leased", "scheduled"))) for k in kinds]
    rows.append(("total", *(str(body["totals"][s]) for s in ("pending", "leased", "scheduled"))))
    lines = table(rows, right={1, 2, 3})
    for kind, shapes in sorted(body.get("server", {}).get("unplaceable", {}).items()):
        for u in shapes:
            lines.append(f"unplaceable: {kind}: {u['pending']} pending ({u['reason']})")
    for kind, p in sorted(body.get("paused", {}).items()):
        lines.append(f"paused: {kind} (by {p['by']} since {p['since']})")
    for q in body.get("quarantined", []):
        lines.append(f"quarantined: {q['device']} since {q['since'][:19]} ({q['reason']}; gpuq device clear {q['device']})")
    oldest = body["oldest_pending_seconds"]
    lines.append(f"oldest pending: {oldest:.1f} s" if oldest is not None else "oldest pending: -")
    lines.append(f"history (done+dead, estimate): {body['history_estimate']}")
    if body.get("tenants"):  # fair share is on
        lines += ["fair share:", *("  " + line for line in tenant_table(body["tenants"]))]
    if "server" in body:
        lines += _render_agents(body["server"])
    return "\n".join(lines)


def _render_agents(server: dict[str, Any]) -> list[str]:
    """The agents a server's ``/status`` lists: each with its labels, devices and jobs' progress."""
    lines = [f"agents connected: {server.get('agents_connected', 0)}"]
    for a in server.get("agents", []):
        lines.append(f"  {a['agent']}  kinds={','.join(a['kinds'])}  inflight={a['inflight']}/{a['capacity']}"
                     f"  protocol={a.get('protocol', '?')}")
        if a.get("labels") or a.get("models"):
            lines.append(f"    labels: {', '.join(a.get('labels', [])) or '-'}"
                         f"  models: {', '.join(a.get('models', [])) or '-'}")
        for d in a.get("devices", []):
            usage = "" if d["utilization"] is None else \
                f"  util {d['utilization']}%  used {d['memory_used_mb']} MiB"
            quarantined = f"  QUARANTINED ({d['quarantined']})" if d.get("quarantined") else ""
            lines.append(f"    gpu {d['index']}: {d['name']} {d['memory_mb']} MiB{usage}{quarantined}")
        for job_id, p in sorted(a.get("progress", {}).items(), key=lambda item: int(item[0])):
            lines.append(f"    job {job_id}: {p['fraction']:.0%}" + (f" {p['message']}" if p["message"] else ""))
    return lines
