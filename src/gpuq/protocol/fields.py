"""One field's value, checked: what parsing and the checked encoders share. No message types.

The protocol's one JSON decoder and encoder live here, with the strict
checks of a single value (a job id, a lease token, a list of ids, a job's
timeout, devices, ``queued_ms``, ``batch`` and its trace, U+0000 in a JSON value) and of a
progress update's values, which both the parser and ``progress_item`` (the
encoder ``JobMessage.progress`` uses) apply. A bad value is a
``ProtocolError`` (``bad_message``) or, where noted, a ``ValueError`` that
the caller words.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from gpuq.protocol.codes import (
    MAX_CHECKPOINT_DATA,
    MAX_HEARTBEAT_IDS,
    MAX_JOB_ID,
    MAX_PROGRESS_DATA,
    MAX_PROGRESS_MESSAGE,
    MAX_TRACESTATE,
    ErrorCode,
    ProtocolError,
)

__all__ = ["checkpoint_data", "checkpoint_item", "contains_nul", "progress_item"]  # what the package exports; the rest is its modules' own

BAD_MESSAGE = ErrorCode.BAD_MESSAGE

# One encoder for every frame: json.dumps with any option builds a new one per call.
to_json = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constants)  # one, not one per frame


def load(frame: str) -> dict[str, Any]:
    """A frame's JSON object, or ``ProtocolError`` (``bad_json``, or ``bad_message`` if not an object)."""
    try:
        obj = _DECODER.decode(frame)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"frame is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_MESSAGE, "a message must be a JSON object with a 'type' field")
    return obj


def exact_fields(obj: dict[str, Any], fields: set[str], fatal: bool) -> None:
    """``obj`` has exactly ``fields``, else ``ProtocolError`` naming the missing and unexpected ones."""
    missing, extra = fields - obj.keys(), obj.keys() - fields
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(sorted(missing))}")
        if extra:
            parts.append(f"unexpected {', '.join(sorted(map(str, extra)))[:200]}")
        raise ProtocolError(BAD_MESSAGE, f"{obj['type']}: {'; '.join(parts)}", fatal=fatal)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def job_id(value: Any) -> int:
    if type(value) is int and 0 < value <= MAX_JOB_ID:  # JSON gives exact ints (never bool)
        return value
    raise ProtocolError(BAD_MESSAGE, f"job id must be a positive 64-bit integer, not {str(value)[:40]!r}")


def job_ids(ids: Any, what: str) -> tuple[int, ...]:
    """A list of at most ``MAX_HEARTBEAT_IDS`` job ids (``what`` names the field in the error)."""
    if not isinstance(ids, list) or len(ids) > MAX_HEARTBEAT_IDS:
        raise ProtocolError(BAD_MESSAGE, f"{what} must be a list of at most {MAX_HEARTBEAT_IDS} job ids")
    return tuple(job_id(i) for i in ids)


_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def token(value: Any) -> str:
    """A lease token as its canonical UUID text."""
    if not isinstance(value, str):
        raise ProtocolError(BAD_MESSAGE, "lease_token must be a string")
    if _CANONICAL_UUID.fullmatch(value):  # as we sent it: the common case, without a UUID object
        return value
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise ProtocolError(BAD_MESSAGE, f"lease_token {value[:40]!r} is not a UUID") from None


def contains_nul(value: Any) -> bool:
    """Whether a JSON value holds U+0000 in any string (keys too): jsonb refuses it."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(contains_nul(v) for v in value)
    if isinstance(value, dict):
        return any("\x00" in k or contains_nul(v) for k, v in value.items())
    return False


# -- a pushed job's optional fields (``ValueError``: the server's frame is malformed) --


def timeout(value: Any) -> float | None:
    if value is None:
        return None
    if not is_int(value) or value < 1:
        raise ValueError(f"job timeout must be a positive integer, not {str(value)[:40]!r}")
    return float(value)


def queued(value: Any) -> int | None:
    if value is not None and (type(value) is not int or value < 0):
        raise ValueError(f"job queued_ms must be a whole number of ms, not {str(value)[:40]!r}")
    return value


def batch_number(value: Any) -> int | None:
    if value is not None and (type(value) is not int or not 0 < value <= MAX_JOB_ID):
        raise ValueError(f"job batch must be a positive integer, not {str(value)[:40]!r}")
    return value


def trace_text(value: Any, name: str, optional: bool = False) -> Any:
    """A pushed job's ``traceparent`` or (``optional``: None allowed) ``tracestate``: a string of
    1-MAX_TRACESTATE characters."""
    if value is None and optional:
        return None
    if type(value) is not str or not 0 < len(value) <= MAX_TRACESTATE:
        raise ValueError(f"job {name} must be a string of 1-{MAX_TRACESTATE} characters, not {str(value)[:40]!r}")
    return value


def device_indices(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(is_int(i) and 0 <= i <= 255 for i in value):
        raise ValueError(f"job devices must be a list of device indices, not {str(value)[:40]!r}")
    return tuple(value)


# -- progress --------------------------------------------------------------


def check_progress(fraction: Any, message: Any, data: Any) -> tuple[float, str | None, str]:
    """The fraction as a float, the message as kept (cut to its limit) and ``data`` as JSON
    (at most ``MAX_PROGRESS_DATA`` bytes), or ``ValueError`` saying what is wrong."""
    if type(fraction) is not float:
        if isinstance(fraction, bool) or not isinstance(fraction, int):
            raise ValueError(f"progress fraction must be a number from 0 to 1, not {str(fraction)[:40]!r}")
        fraction = float(fraction)
    if not 0.0 <= fraction <= 1.0:  # NaN too
        raise ValueError(f"progress fraction must be a number from 0 to 1, not {fraction!r}")
    if message is not None:
        if not isinstance(message, str):
            raise ValueError(f"progress message must be a string or None, not {type(message).__name__}")
        message = message[:MAX_PROGRESS_MESSAGE].replace("\x00", "\ufffd")
    if data is None:
        return fraction, message, "null"
    try:
        data_json = to_json(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"progress data is not JSON-serializable: {exc}") from None
    if len(data_json) > MAX_PROGRESS_DATA:
        raise ValueError(f"progress data of {len(data_json)} bytes as JSON is over the limit of {MAX_PROGRESS_DATA}")
    if "\\u0000" in data_json and contains_nul(data):
        raise ValueError("progress data must not contain the character U+0000 (jsonb cannot store it)")
    return fraction, message, data_json


def progress_item(job_id: int, lease_token: str, fraction: float, message: str | None = None,
                  data: Any = None) -> str:
    """One progress update as JSON, checked (``ValueError`` for a bad value): what ``job.progress``
    queues. ``lease_token`` is spliced: a canonical UUID, as the server pushed it."""
    fraction, message, data_json = check_progress(fraction, message, data)
    text = "null" if message is None else to_json(message)
    return (f'{{"id":{job_id:d},"lease_token":"{lease_token}","fraction":{fraction!r},"message":{text},'
            f'"data":{data_json}}}')


# -- checkpoints -------------------------------------------------------------


def checkpoint_data(data: Any) -> str:
    """A checkpoint's data as compact JSON: any JSON value but null (a job without a checkpoint
    resumes from None), at most ``MAX_CHECKPOINT_DATA`` bytes, without U+0000; else ``ValueError``
    saying what is wrong."""
    if data is None:
        raise ValueError("checkpoint data must not be None: a job without a checkpoint resumes from None")
    try:
        data_json = to_json(data)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"checkpoint data is not JSON-serializable: {exc}") from None
    if len(data_json.encode()) > MAX_CHECKPOINT_DATA:
        raise ValueError(f"checkpoint data of {len(data_json.encode())} bytes as JSON is over the limit of "
                         f"{MAX_CHECKPOINT_DATA}")
    if "\\u0000" in data_json and contains_nul(data):
        raise ValueError("checkpoint data must not contain the character U+0000 (jsonb cannot store it)")
    return data_json


def checkpoint_item(job_id: int, lease_token: str, seq: int, data_json: str) -> str:
    """One checkpoint of a ``checkpoint`` message, as JSON, around data checked by
    ``checkpoint_data``; ``lease_token`` is spliced (a canonical UUID, as the server pushed it)."""
    return f'{{"id":{job_id:d},"lease_token":"{lease_token}","seq":{seq:d},"data":{data_json}}}'
