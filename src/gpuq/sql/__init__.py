"""The named SQL statements of ``queries.sql``, loaded once: ``queries["lease_slots"]``, and ``DB``, what runs them.

A block is ``-- name: NAME``, one ``--`` line of description, then the
statement up to the next block. The text is used as written: the same string
on every call, so asyncpg's statement cache and generic plans apply.
"""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path
from typing import Any, Protocol


class DB(Protocol):
    """What the statements run on: an asyncpg Connection or Pool (both have fetch/execute)."""

    async def fetch(self, query: str, *args: Any, timeout: float | None = None) -> list[Any]: ...
    async def fetchrow(self, query: str, *args: Any) -> Any: ...
    async def fetchval(self, query: str, *args: Any) -> Any: ...
    async def execute(self, query: str, *args: Any) -> str: ...


_BLOCK = re.compile(r"^-- name: (\w+)\n-- (.+)\n", re.MULTILINE)


def parse(text: str) -> dict[str, str]:
    """``name -> statement`` for every block; a repeated name is an error."""
    found: dict[str, str] = {}
    heads = list(_BLOCK.finditer(text))
    for i, head in enumerate(heads):
        end = heads[i + 1].start() if i + 1 < len(heads) else len(text)
        name = head.group(1)
        if name in found:
            raise ValueError(f"queries.sql: the name {name!r} is used twice")
        statement = text[head.end():end].strip()
        if not statement:
            raise ValueError(f"queries.sql: {name!r} has no statement")
        found[name] = statement
    return found


def descriptions(text: str) -> dict[str, str]:
    """``name -> one-line description`` (for docs and tests)."""
    return {m.group(1): m.group(2) for m in _BLOCK.finditer(text)}


def load(path: Path | None = None) -> dict[str, str]:
    text = path.read_text() if path else resources.files(__name__).joinpath("queries.sql").read_text()
    return parse(text)


queries = load()
