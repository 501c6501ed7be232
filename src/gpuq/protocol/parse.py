"""Parsing frames into messages, strictly: every field checked. No encoding, no state.

JSON text frames over one websocket (docs/protocol.md). Parsing is strict: an
unknown type, a missing or extra field, a value of the wrong type or out of
range is a ``ProtocolError`` carrying the error code the server sends back.
A ``fatal`` error (a binary frame, anything wrong with a ``hello``) means the
connection must close; what each side then does is ``server_side`` and
``agent_side``'s rule. ``parse_client`` reads an agent's frames (the server
side), ``parse_server`` the server's (the agent side).
"""

from __future__ import annotations

import re
from typing import Any

from gpuq.kinds import KIND_RULE, is_kind
from gpuq.protocol import fast
from gpuq.protocol import messages as m
from gpuq.protocol.codes import (
    BATCH_SINCE,
    MAX_BATCH_ITEMS,
    MAX_CANCEL_IDS,
    MAX_CAPACITY,
    MAX_ERROR_TEXT,
    MAX_FAULT_ERROR,
    MAX_JOB_ID,
    MAX_KINDS,
    MAX_PREEMPT_SECONDS,
    MAX_PREFETCH,
    MAX_RESULTS,
    PLACEMENT_SINCE,
    PREFETCH_SINCE,
    SUPPORTED_VERSIONS,
    CloseCode,
    ErrorCode,
    ProtocolError,
)
from gpuq.protocol.describe import (
    MAX_DEVICE_INDEX,
    MAX_DEVICES,
    check_labels,
    check_models,
    devices_from,
    usage_from,
)
from gpuq.protocol.fields import (
    BAD_MESSAGE,
    batch_number,
    check_progress,
    checkpoint_data,
    contains_nul,
    device_indices,
    exact_fields,
    is_int,
    job_id,
    job_ids,
    load,
    queued,
    timeout,
    token,
    trace_text,
)
from gpuq.protocol.slots import slots_from

__all__ = ["AGENT_NAME", "parse_client", "parse_server"]

AGENT_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")
FAULT_SOURCES = ("handler", "xid", "ecc")  # what saw a device fault: the handler, NVML (Xid, ECC)


# --------------------------------------------------------------------------
# Frames from the agent
# --------------------------------------------------------------------------


def parse_client(frame: str | bytes, max_size: int) -> m.ClientMessage:
    """Parse one frame from an agent, or raise ``ProtocolError``: outcomes by ``fast`` (the same
    message), anything it does not take (every error too) by ``parse_client_slow``."""
    if type(frame) is str and len(frame) <= max_size and (msg := fast.client_message(frame)) is not None:
        return msg
    return parse_client_slow(frame, max_size)


def parse_client_slow(frame: str | bytes, max_size: int) -> m.ClientMessage:
    """Parse one frame from an agent with ``json`` and the checks here, or raise ``ProtocolError``."""
    if isinstance(frame, bytes):
        raise ProtocolError(BAD_MESSAGE, "binary frames are not supported; send JSON text", fatal=True,
                            close=CloseCode.UNSUPPORTED_DATA)
    if len(frame) > max_size:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {len(frame)} bytes is over the limit of {max_size}")
    obj = load(frame)
    kind = obj.get("type")
    fields = _CLIENT_FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}; expected one of "
                            f"{', '.join(sorted(_CLIENT_FIELDS))}", fatal=kind == "hello")
    if kind == "hello" and (version := _hello_version(obj)) >= PLACEMENT_SINCE:
        fields = (_HELLO_7_FIELDS if version >= BATCH_SINCE else _HELLO_5_FIELDS if version >= PREFETCH_SINCE
                  else _HELLO_4_FIELDS)
    elif kind == "heartbeat":
        fields = fields | ({"devices"} & obj.keys()) | ({"slots"} & obj.keys())
    elif kind == "results" and "started" in obj:
        fields = _RESULTS_5_FIELDS
    exact_fields(obj, fields, fatal=kind == "hello")
    if kind == "hello":
        return _hello(obj)
    if kind in _OUTCOME_FIELDS:
        return _outcome(obj, "\\u0000" in frame)
    if kind == "results":
        items = obj["results"]
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_RESULTS:
            raise ProtocolError(BAD_MESSAGE, f"results.results must be a list of 1-{MAX_RESULTS} "
                                "done, failed or preempted messages")
        maybe_nul = "\\u0000" in frame
        return m.Results(tuple(_outcome(item, maybe_nul) for item in items),
                         job_ids(obj["started"], "results.started") if "started" in obj else ())
    if kind in ("started", "release"):
        return (m.Started if kind == "started" else m.Release)(job_ids(obj["ids"], f"{kind}.ids"))
    if kind == "heartbeat":
        return m.Heartbeat(job_ids(obj["ids"], "heartbeat.ids"), usage_from(obj["devices"]) if "devices" in obj else None,
                           slots_from(obj["slots"]) if "slots" in obj else None)
    if kind == "update":
        return m.Update(None if obj["labels"] is None else check_labels(obj["labels"], "update.labels"),
                        None if obj["models"] is None else check_models(obj["models"], "update.models"))
    if kind == "device_fault":
        return _device_fault(obj)
    if kind == "progress":
        updates = obj["updates"]
        if not isinstance(updates, list) or not 1 <= len(updates) <= MAX_RESULTS:
            raise ProtocolError(BAD_MESSAGE, f"progress.updates must be a list of 1-{MAX_RESULTS} updates")
        return m.Progress(tuple(_progress_update(u) for u in updates))
    if kind == "checkpoint":
        items = obj["checkpoints"]
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_RESULTS:
            raise ProtocolError(BAD_MESSAGE, f"checkpoint.checkpoints must be a list of 1-{MAX_RESULTS} checkpoints")
        return m.Checkpoint(tuple(_checkpoint_item(c) for c in items))
    return m.Drain()


_OUTCOME_FIELDS = {
    "done": {"type", "id", "lease_token", "result"},
    "failed": {"type", "id", "lease_token", "error", "retryable"},
    "preempted": {"type", "id", "lease_token"},  # protocol 9
}
_CLIENT_FIELDS = {
    "hello": {"type", "agent", "kinds", "capacity", "protocol"},
    **_OUTCOME_FIELDS,
    "results": {"type", "results"},
    "heartbeat": {"type", "ids"},
    "drain": {"type"},
    "progress": {"type", "updates"},
    "checkpoint": {"type", "checkpoints"},
    "update": {"type", "labels", "models"},
    "started": {"type", "ids"},
    "release": {"type", "ids"},
    "device_fault": {"type", "devices", "source", "error", "job"},
}
_HELLO_4_FIELDS = _CLIENT_FIELDS["hello"] | {"devices", "labels", "models"}
_HELLO_5_FIELDS = _HELLO_4_FIELDS | {"prefetch"}
_HELLO_7_FIELDS = _HELLO_5_FIELDS | {"batch"}
_RESULTS_5_FIELDS = _CLIENT_FIELDS["results"] | {"started"}
_PROGRESS_FIELDS = {"id", "lease_token", "fraction", "message", "data"}


def _progress_update(obj: Any) -> m.ProgressUpdate:
    if not isinstance(obj, dict) or obj.keys() != _PROGRESS_FIELDS:
        raise ProtocolError(BAD_MESSAGE, "each progress update must be an object with exactly "
                            f"{', '.join(sorted(_PROGRESS_FIELDS))}")
    try:
        fraction, message, _ = check_progress(obj["fraction"], obj["message"], obj["data"])
    except ValueError as exc:
        raise ProtocolError(BAD_MESSAGE, str(exc)) from None
    return m.ProgressUpdate(job_id(obj["id"]), token(obj["lease_token"]), fraction, message, obj["data"])


def _device_fault(obj: dict[str, Any]) -> m.DeviceFault:
    """Protocol 9: ``devices`` (1-64 distinct indices), ``source`` (handler, xid, ecc), ``error``
    (a string, kept up to ``MAX_FAULT_ERROR`` characters), ``job`` (a job id, or null)."""
    devices = obj["devices"]
    if (not isinstance(devices, list) or not 1 <= len(devices) <= MAX_DEVICES
            or not all(type(i) is int and 0 <= i <= MAX_DEVICE_INDEX for i in devices)
            or len(set(devices)) < len(devices)):
        raise ProtocolError(BAD_MESSAGE, f"device_fault.devices must be a list of 1-{MAX_DEVICES} distinct "
                            f"device indices 0-{MAX_DEVICE_INDEX}")
    if obj["source"] not in FAULT_SOURCES:
        raise ProtocolError(BAD_MESSAGE, f"device_fault.source must be one of {', '.join(FAULT_SOURCES)}")
    if not isinstance(obj["error"], str):
        raise ProtocolError(BAD_MESSAGE, "device_fault.error must be a string")
    job = None if obj["job"] is None else job_id(obj["job"])
    return m.DeviceFault(tuple(devices), obj["source"], obj["error"][:MAX_FAULT_ERROR].replace("\x00", "\ufffd"),
                         job)


_CHECKPOINT_FIELDS = {"id", "lease_token", "seq", "data"}


def _checkpoint_item(obj: Any) -> m.CheckpointItem:
    if not isinstance(obj, dict) or obj.keys() != _CHECKPOINT_FIELDS:
        raise ProtocolError(BAD_MESSAGE, "each checkpoint must be an object with exactly "
                            f"{', '.join(sorted(_CHECKPOINT_FIELDS))}")
    try:
        checkpoint_data(obj["data"])
    except ValueError as exc:
        raise ProtocolError(BAD_MESSAGE, str(exc)) from None
    return m.CheckpointItem(job_id(obj["id"]), token(obj["lease_token"]), _seq(obj["seq"]), obj["data"])


def _seq(value: Any) -> int:
    if type(value) is int and 0 < value <= MAX_JOB_ID:
        return value
    raise ProtocolError(BAD_MESSAGE, f"checkpoint seq must be a positive 64-bit integer, not {str(value)[:40]!r}")


def _outcome(obj: Any, maybe_nul: bool) -> m.Outcome:
    """A done, failed or preempted object, alone or inside ``results``."""
    kind = obj.get("type") if isinstance(obj, dict) else None
    fields = _OUTCOME_FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise ProtocolError(BAD_MESSAGE, "each outcome must be a done, failed or preempted message")
    if obj.keys() != fields:
        exact_fields(obj, fields, fatal=False)
    if kind == "preempted":
        return m.Preempted(job_id(obj["id"]), token(obj["lease_token"]))
    if kind == "done":
        # PostgreSQL's jsonb cannot store U+0000: refuse it here, not in a batch write.
        if maybe_nul and contains_nul(obj["result"]):
            raise ProtocolError(BAD_MESSAGE, "done.result must not contain the character U+0000")
        return m.Done(job_id(obj["id"]), token(obj["lease_token"]), obj["result"])
    error = obj["error"]
    if not isinstance(error, str):
        raise ProtocolError(BAD_MESSAGE, "failed.error must be a string")
    if not isinstance(obj["retryable"], bool):
        raise ProtocolError(BAD_MESSAGE, "failed.retryable must be true or false")
    return m.Failed(job_id(obj["id"]), token(obj["lease_token"]),
                    error[:MAX_ERROR_TEXT].replace("\x00", "\ufffd"), obj["retryable"])

def _hello_version(obj: dict[str, Any]) -> int:
    """The hello's protocol version, checked first: its fields depend on it."""
    version = obj.get("protocol")
    if version not in SUPPORTED_VERSIONS or not is_int(version):
        raise ProtocolError(BAD_MESSAGE, f"protocol {str(version)[:40]!r} is not supported; this server speaks "
                            f"{', '.join(map(str, SUPPORTED_VERSIONS))}", fatal=True,
                            close=CloseCode.UNSUPPORTED_VERSION)
    return int(version)


def _hello(obj: dict[str, Any]) -> m.Hello:
    version = obj["protocol"]
    agent, kinds, capacity = obj["agent"], obj["kinds"], obj["capacity"]
    if not isinstance(agent, str) or not AGENT_NAME.fullmatch(agent):
        raise ProtocolError(BAD_MESSAGE, "hello.agent must be 1-64 characters of A-Z a-z 0-9 _ . : @ -",
                            fatal=True)
    if (not isinstance(kinds, list) or not 1 <= len(kinds) <= MAX_KINDS
            or not all(is_kind(k) for k in kinds)):
        raise ProtocolError(BAD_MESSAGE, f"hello.kinds must be a list of 1-{MAX_KINDS} job kinds "
                            f"({KIND_RULE})", fatal=True)
    if not is_int(capacity) or not 1 <= capacity <= MAX_CAPACITY:
        raise ProtocolError(BAD_MESSAGE, f"hello.capacity must be an integer 1-{MAX_CAPACITY}", fatal=True)
    if version < PLACEMENT_SINCE:
        return m.Hello(agent, tuple(dict.fromkeys(kinds)), capacity, version)
    prefetch = obj.get("prefetch", 0)
    if not is_int(prefetch) or not 0 <= prefetch <= MAX_PREFETCH:
        raise ProtocolError(BAD_MESSAGE, f"hello.prefetch must be an integer 0-{MAX_PREFETCH}", fatal=True)
    batch = obj.get("batch", 0)
    if not is_int(batch) or not 0 <= batch <= MAX_BATCH_ITEMS:
        raise ProtocolError(BAD_MESSAGE, f"hello.batch must be an integer 0-{MAX_BATCH_ITEMS}", fatal=True)
    return m.Hello(agent, tuple(dict.fromkeys(kinds)), capacity, version, devices_from(obj["devices"]),
                   check_labels(obj["labels"], "hello.labels", fatal=True),
                   check_models(obj["models"], "hello.models", fatal=True), prefetch, batch)



# --------------------------------------------------------------------------
# Frames from the server
# --------------------------------------------------------------------------


def parse_server(frame: str | bytes) -> m.ServerMessage:
    """Parse one frame from the server (the agent side); ``ProtocolError`` if malformed. ``jobs`` by
    ``fast`` (the same message), anything it does not take by ``parse_server_slow``."""
    if type(frame) is str and (msg := fast.server_jobs(frame)) is not None:
        return msg
    return parse_server_slow(frame)


def parse_server_slow(frame: str | bytes) -> m.ServerMessage:
    """Parse one frame from the server with ``json`` and the checks here; ``ProtocolError`` if malformed."""
    if isinstance(frame, bytes):
        raise ProtocolError(BAD_MESSAGE, "binary frame from the server")
    obj = load(frame)
    kind = obj.get("type")
    try:
        if kind == "welcome":
            return m.Welcome(str(obj["agent_id"]), float(obj["lease_seconds"]),
                             float(obj["heartbeat_seconds"]), int(obj["max_payload"]), int(obj["protocol"]))
        if kind == "jobs":
            return m.Jobs(tuple(m.JobMessage(job_id(j["id"]), token(j["lease_token"]), str(j["kind"]),
                                             j["payload"], int(j["attempt"]), timeout(j.get("timeout")),
                                             device_indices(j.get("devices")), queued(j.get("queued_ms")),
                                             batch_number(j.get("batch")), _trace(j) if "traceparent" in j else None,
                                             j.get("resume_from"), _grace(j.get("grace_seconds")))
                                for j in obj["jobs"]))
        if kind == "ack":
            return m.Ack(tuple(job_id(i) for i in obj["accepted"]), tuple(job_id(i) for i in obj["rejected"]))
        if kind == "drain":
            return m.ServerDrain(float(obj["deadline_seconds"]))
        if kind == "error":
            return m.Error(str(obj["code"]), str(obj["message"]))
        if kind == "checkpointed":
            return m.Checkpointed(tuple(job_id(i) for i in obj["stored"]), tuple(job_id(i) for i in obj["refused"]))
        if kind == "cancel":
            ids = obj["ids"]
            if not isinstance(ids, list) or len(ids) > MAX_CANCEL_IDS:
                raise ValueError(f"cancel.ids must be a list of at most {MAX_CANCEL_IDS} job ids")
            return m.Cancel(tuple(job_id(i) for i in ids))
        if kind == "preempt":
            ids, seconds = obj["ids"], obj["deadline_seconds"]
            if not isinstance(ids, list) or len(ids) > MAX_CANCEL_IDS:
                raise ValueError(f"preempt.ids must be a list of at most {MAX_CANCEL_IDS} job ids")
            if not isinstance(seconds, int | float) or isinstance(seconds, bool) \
                    or not 0 <= seconds <= MAX_PREEMPT_SECONDS:
                raise ValueError(f"preempt.deadline_seconds must be a number 0-{MAX_PREEMPT_SECONDS:g}")
            return m.Preempt(tuple(job_id(i) for i in ids), float(seconds))
    except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(1e400), float(10**400)
        raise ProtocolError(BAD_MESSAGE, f"malformed {kind} message from the server: {exc}") from None
    raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r} from the server")


def _grace(value: Any) -> float | None:
    """A pushed job's ``grace_seconds`` (protocol 9: it is preemptible), or None."""
    if value is None:
        return None
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 < value <= MAX_PREEMPT_SECONDS:
        raise ValueError(f"jobs[].grace_seconds must be a number above 0, at most {MAX_PREEMPT_SECONDS:g}")
    return float(value)


def _trace(job: dict[str, Any]) -> tuple[str, str | None]:
    """A pushed job's trace (protocol 8): its ``traceparent``, and ``tracestate`` if any."""
    return trace_text(job["traceparent"], "traceparent"), trace_text(job.get("tracestate"), "tracestate", True)

