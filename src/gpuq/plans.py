"""Planner guards and EXPLAIN readers: how gpuq keeps its statements on the partial indexes.

``PLAN_SETTINGS`` start every connection gpuq opens (docs/design.md, "Planner
settings"): queue statistics are always stale, so the planner is left only the
ordered index walk, planned once per connection. The EXPLAIN helpers serve the
history-independence tests and ``gpuq bench lease-history``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from gpuq.sql import queries

PLAN_SETTINGS = {"enable_bitmapscan": "off", "enable_seqscan": "off", "plan_cache_mode": "force_generic_plan"}


async def explain(conn: Any, statement: str, *args: Any) -> dict[str, Any]:
    """EXPLAIN (ANALYZE, BUFFERS) of any statement with ``args``, rolled back: the plan as a dict.

    ``conn`` must be a Connection (the statement runs inside a transaction).
    """
    tx = conn.transaction()
    await tx.start()
    try:
        raw = await conn.fetchval("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + statement, *args)
    finally:
        await tx.rollback()
    plan = (json.loads(raw) if isinstance(raw, str) else raw)[0]
    return dict(plan)


async def explain_lease(conn: Any, kinds: Sequence[str], n: int) -> dict[str, Any]:
    """The executed plan of leasing ``n`` jobs of ``kinds``, rolled back."""
    return await explain(conn, queries["lease_slots"], list(kinds), n, ["explain"] * n, 30.0)


def plan_buffers(plan: dict[str, Any], *, reads_only: bool = False) -> int:
    """Shared buffers (hit + read) the executed plan touched, planning excluded.

    ``reads_only``: only the finding and locking of the rows (the ``picked``
    and ``expired`` CTEs), not the writing of new row versions and their index
    entries, whose B-tree descent grows (logarithmically) with the table like
    any insert's.
    """
    nodes = [plan["Plan"]]
    if reads_only:
        nodes = [n for n in plan["Plan"].get("Plans", [])
                 if n.get("Subplan Name") in ("CTE picked", "CTE expired")]
    return sum(int(n.get("Shared Hit Blocks", 0)) + int(n.get("Shared Read Blocks", 0)) for n in nodes)


def plan_indexes(plan: dict[str, Any]) -> set[str]:
    """Names of every index the plan scans, and the relations it scans sequentially."""
    found: set[str] = set()

    def walk(node: dict[str, Any]) -> None:
        if "Index Name" in node:
            found.add(node["Index Name"])
        if node.get("Node Type") == "Seq Scan":
            found.add(f"seqscan:{node.get('Relation Name')}")
        for child in node.get("Plans", []):
            walk(child)

    walk(plan["Plan"])
    return found
