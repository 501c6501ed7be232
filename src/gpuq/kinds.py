"""The rule for job kinds, one copy for the producer, the protocol and the CLI.

It mirrors the ``jobs_kind_format`` CHECK of the table (migrations 0001/0002):
kinds travel comma-joined in NOTIFY payloads and are spliced unescaped into
pushed jobs, so they hold no comma and nothing JSON would escape.
"""

from __future__ import annotations

import re

KIND_PATTERN = re.compile(r"[A-Za-z0-9_.:/-]{1,128}")
KIND_RULE = "1-128 characters of A-Z a-z 0-9 _ . : / -"


def is_kind(value: object) -> bool:
    return isinstance(value, str) and KIND_PATTERN.fullmatch(value) is not None
