"""Planner guards and EXPLAIN readers: how gpuq keeps its statements on the partial indexes.

``PLAN_SETTINGS`` start every connection gpuq opens (docs/design.md, "Planner
settings"): queue statistics are always stale, so the planner is left only the
ordered index walk, planned once per connection. The EXPLAIN helpers serve the
history-independence tests and ``gpuq bench lease-history``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gpuq.sql import queries

# A cursor is the (priority, id) of the last job a lease of the kind took; the
# next lease walks jobs_pending_idx (kind, -priority, id) from just past it.
# START is above every priority (at most 32767), so it covers the whole index.
START = (32768, 0)


def lease_args(kinds: Sequence[str], slots: Sequence[str], lease_seconds: float,
               cursors: Mapping[str, tuple[int, int]] | None = None) -> tuple[Any, ...]:
    """The parameters of the ``lease_slots`` statement (a cursor's rank is -priority)."""
    at = [(cursors or {}).get(k, START) for k in kinds]
    return (list(kinds), len(slots), list(slots), float(lease_seconds), [-p for p, _ in at], [i for _, i in at])

# jit: with the scans priced out, a statement that has no other path costs
# 1e10 and would be JIT-compiled on every call; gpuq's statements are short.
PLAN_SETTINGS = {"enable_bitmapscan": "off", "enable_seqscan": "off", "plan_cache_mode": "force_generic_plan",
                 "jit": "off"}


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


async def explain_warm(conn: Any, statement: str, *args: Any) -> dict[str, Any]:
    """``explain`` run twice: the second plan, with the caches and the plan warm (what a statement
    that runs again and again reads)."""
    await explain(conn, statement, *args)
    return await explain(conn, statement, *args)


async def statements_buffers(conn: Any, statements: Mapping[str, tuple[Any, ...]]) -> dict[str, int]:
    """Buffers each ``name -> (statement, *args)`` reads, warm (``explain_warm``)."""
    return {name: plan_buffers(await explain_warm(conn, statement, *args))
            for name, (statement, *args) in statements.items()}


async def explain_lease(conn: Any, kinds: Sequence[str], n: int,
                        cursors: Mapping[str, tuple[int, int]] | None = None) -> dict[str, Any]:
    """The executed plan of leasing ``n`` jobs of ``kinds`` (from ``cursors``), rolled back."""
    return await explain(conn, queries["lease_slots"], *lease_args(kinds, ["explain"] * n, 30.0, cursors))


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
