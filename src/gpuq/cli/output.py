"""What commands leave besides their result: aligned text tables, and the structured admin event
every admin action writes on stderr, naming who did it."""

from __future__ import annotations

import getpass
import sys
from typing import Any

from gpuq import logs


def table(rows: list[tuple[str, ...]], right: set[int]) -> list[str]:
    """Rows as aligned text lines; the columns in ``right`` flush right (numbers)."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths, strict=True)))
            .rstrip() for r in rows]


def admin_event(action: str, **fields: Any) -> None:
    """Every admin action is a structured event on stderr naming who did it."""
    logs.configure(stream=sys.stderr)
    logs.get("admin").info(f"admin.{action}", by=getpass.getuser(), **fields)
