"""Command-line values that are more than text: JSON, ISO 8601 times, a whole number or none."""

from __future__ import annotations

import argparse
import json
from datetime import datetime
from typing import Any

from gpuq.cli.errors import CLIError


def json_arg(text: str, what: str) -> Any:
    try:
        return json.loads(text)
    except ValueError as exc:
        raise CLIError(f"{what} is not valid JSON: {exc}") from None


def timestamp(text: str) -> datetime:
    """An argparse type: an ISO 8601 time; without a zone, local time."""
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO 8601 time: {text!r}") from None
    return value if value.tzinfo else value.astimezone()  # no zone given: local time


def whole_or_none(text: str | None, what: str) -> int | None:
    """``text`` as a whole number; None for ``none`` or no value. The error reads
    ``<what> or none, not '<text>'``."""
    if text is None or text == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise CLIError(f"{what} or none, not {text!r}") from None
