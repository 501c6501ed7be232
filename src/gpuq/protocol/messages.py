"""The agent protocol's messages: types, strict parsing, encoding. No I/O, no state.

JSON text frames over one websocket (docs/protocol.md). Parsing is strict: an
unknown type, a missing or extra field, a value of the wrong type or out of
range is a ``ProtocolError`` carrying the error code the server sends back.
A ``fatal`` error (a binary frame, anything wrong with a ``hello``) means the
connection must close; what each side then does is ``server_side`` and
``agent_side``'s rule.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gpuq.kinds import KIND_RULE, is_kind
from gpuq.protocol.codes import (
    MAX_CANCEL_IDS,
    MAX_CAPACITY,
    MAX_ERROR_TEXT,
    MAX_HEARTBEAT_IDS,
    MAX_JOB_ID,
    MAX_KINDS,
    MAX_PREFETCH,
    MAX_PROGRESS_DATA,
    MAX_PROGRESS_MESSAGE,
    MAX_RESULTS,
    PLACEMENT_SINCE,
    PREFETCH_SINCE,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    CloseCode,
    ErrorCode,
    ProtocolError,
)
from gpuq.protocol.describe import (
    Device,
    DeviceUsage,
    check_labels,
    check_models,
    device_json,
    devices_from,
    usage_from,
    usage_json,
)
from gpuq.protocol.slots import SlotReport, slots_from, slots_json

__all__ = ["AGENT_NAME", "RESULTS_OVERHEAD", "Ack", "Cancel", "ClientMessage", "Done", "Drain", "Error", "Failed", "Heartbeat",
           "Hello", "JobMessage", "Jobs", "Progress", "ProgressUpdate", "Release", "Results", "ServerDrain", "ServerMessage",
           "Started", "Update", "Welcome", "attach_reporter", "contains_nul", "encode", "encode_done", "job_message", "jobs_frame",
           "mark_cancelled", "pack_progress", "pack_results", "parse_client", "parse_server", "progress_item"]

AGENT_NAME = re.compile(r"[A-Za-z0-9_.:@-]{1,64}")
BAD_MESSAGE = ErrorCode.BAD_MESSAGE


# --------------------------------------------------------------------------
# Messages from the agent
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Hello:
    agent: str
    kinds: tuple[str, ...]
    capacity: int
    protocol: int = PROTOCOL_VERSION
    # Protocol 4: what the agent has (describe.py). Sent only by agents of version 4.
    devices: tuple[Device, ...] = ()
    labels: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    # Protocol 5: jobs the server may push beyond ``capacity``, held ready for the next free slot.
    prefetch: int = 0


@dataclass(frozen=True, slots=True)
class Done:
    id: int
    lease_token: str
    result: Any


@dataclass(frozen=True, slots=True)
class Failed:
    id: int
    lease_token: str
    error: str
    retryable: bool


@dataclass(frozen=True, slots=True)
class Results:
    """Many outcomes in one frame: how the agent library reports (one frame, one parse)."""

    outcomes: tuple[Done | Failed, ...]
    started: tuple[int, ...] = ()  # protocol 5: as ``Started``, in the same frame


@dataclass(frozen=True, slots=True)
class Started:
    """From the agent (protocol 5): these jobs' handlers have started (a prefetched job that never
    started goes back without counting its attempt)."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Release:
    """From the agent (protocol 5): it will not start these prefetched jobs (it is draining)."""

    ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Heartbeat:
    ids: tuple[int, ...]
    devices: tuple[DeviceUsage, ...] | None = None  # protocol 4, when the agent can read them (NVML)
    slots: SlotReport | None = None  # protocol 6: busy time and gaps since the last report


@dataclass(frozen=True, slots=True)
class Update:
    """From the agent (protocol 4): its labels and/or warm models changed (None: unchanged)."""

    labels: tuple[str, ...] | None
    models: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class Drain:
    """From the agent: send me no more jobs (I am finishing and leaving)."""


@dataclass(frozen=True, slots=True)
class ProgressUpdate:
    """How far one running job has got: ``fraction`` 0-1, an optional message and JSON ``data``."""

    id: int
    lease_token: str
    fraction: float
    message: str | None
    data: Any


@dataclass(frozen=True, slots=True)
class Progress:
    """From the agent (protocol 3): the latest progress of running jobs, coalesced."""

    updates: tuple[ProgressUpdate, ...]


ClientMessage = Hello | Done | Failed | Results | Heartbeat | Drain | Progress | Update | Started | Release


def parse_client(frame: str | bytes, max_size: int) -> ClientMessage:
    """Parse one frame from an agent, or raise ``ProtocolError``."""
    if isinstance(frame, bytes):
        raise ProtocolError(BAD_MESSAGE, "binary frames are not supported; send JSON text", fatal=True,
                            close=CloseCode.UNSUPPORTED_DATA)
    if len(frame) > max_size:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"frame of {len(frame)} bytes is over the limit of {max_size}")
    obj = _load(frame)
    kind = obj.get("type")
    fields = _CLIENT_FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r}; expected one of "
                            f"{', '.join(sorted(_CLIENT_FIELDS))}", fatal=kind == "hello")
    if kind == "hello" and (version := _hello_version(obj)) >= PLACEMENT_SINCE:
        fields = _HELLO_5_FIELDS if version >= PREFETCH_SINCE else _HELLO_4_FIELDS
    elif kind == "heartbeat":
        fields = fields | ({"devices"} & obj.keys()) | ({"slots"} & obj.keys())
    elif kind == "results" and "started" in obj:
        fields = _RESULTS_5_FIELDS
    _exact_fields(obj, fields, fatal=kind == "hello")
    if kind == "hello":
        return _hello(obj)
    if kind in ("done", "failed"):
        return _outcome(obj, "\\u0000" in frame)
    if kind == "results":
        items = obj["results"]
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_RESULTS:
            raise ProtocolError(BAD_MESSAGE, f"results.results must be a list of 1-{MAX_RESULTS} "
                                "done or failed messages")
        maybe_nul = "\\u0000" in frame
        return Results(tuple(_outcome(item, maybe_nul) for item in items),
                       _ids(obj["started"], "results.started") if "started" in obj else ())
    if kind in ("started", "release"):
        return (Started if kind == "started" else Release)(_ids(obj["ids"], f"{kind}.ids"))
    if kind == "heartbeat":
        ids = obj["ids"]
        if not isinstance(ids, list) or len(ids) > MAX_HEARTBEAT_IDS:
            raise ProtocolError(BAD_MESSAGE, f"heartbeat.ids must be a list of at most {MAX_HEARTBEAT_IDS} job ids")
        return Heartbeat(tuple(_job_id(i) for i in ids), usage_from(obj["devices"]) if "devices" in obj else None,
                         slots_from(obj["slots"]) if "slots" in obj else None)
    if kind == "update":
        return Update(None if obj["labels"] is None else check_labels(obj["labels"], "update.labels"),
                      None if obj["models"] is None else check_models(obj["models"], "update.models"))
    if kind == "progress":
        updates = obj["updates"]
        if not isinstance(updates, list) or not 1 <= len(updates) <= MAX_RESULTS:
            raise ProtocolError(BAD_MESSAGE, f"progress.updates must be a list of 1-{MAX_RESULTS} updates")
        return Progress(tuple(_progress_update(u) for u in updates))
    return Drain()


_OUTCOME_FIELDS = {
    "done": {"type", "id", "lease_token", "result"},
    "failed": {"type", "id", "lease_token", "error", "retryable"},
}
_CLIENT_FIELDS = {
    "hello": {"type", "agent", "kinds", "capacity", "protocol"},
    **_OUTCOME_FIELDS,
    "results": {"type", "results"},
    "heartbeat": {"type", "ids"},
    "drain": {"type"},
    "progress": {"type", "updates"},
    "update": {"type", "labels", "models"},
    "started": {"type", "ids"},
    "release": {"type", "ids"},
}
_HELLO_4_FIELDS = _CLIENT_FIELDS["hello"] | {"devices", "labels", "models"}
_HELLO_5_FIELDS = _HELLO_4_FIELDS | {"prefetch"}
_RESULTS_5_FIELDS = _CLIENT_FIELDS["results"] | {"started"}
_PROGRESS_FIELDS = {"id", "lease_token", "fraction", "message", "data"}


def _ids(ids: Any, what: str) -> tuple[int, ...]:
    if not isinstance(ids, list) or len(ids) > MAX_HEARTBEAT_IDS:
        raise ProtocolError(BAD_MESSAGE, f"{what} must be a list of at most {MAX_HEARTBEAT_IDS} job ids")
    return tuple(_job_id(i) for i in ids)


def _progress_update(obj: Any) -> ProgressUpdate:
    if not isinstance(obj, dict) or obj.keys() != _PROGRESS_FIELDS:
        raise ProtocolError(BAD_MESSAGE, "each progress update must be an object with exactly "
                            f"{', '.join(sorted(_PROGRESS_FIELDS))}")
    try:
        fraction, message, _ = _check_progress(obj["fraction"], obj["message"], obj["data"])
    except ValueError as exc:
        raise ProtocolError(BAD_MESSAGE, str(exc)) from None
    return ProgressUpdate(_job_id(obj["id"]), _token(obj["lease_token"]), fraction, message, obj["data"])


def _check_progress(fraction: Any, message: Any, data: Any) -> tuple[float, str | None, str]:
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
        data_json = _to_json(data)
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
    fraction, message, data_json = _check_progress(fraction, message, data)
    text = "null" if message is None else _to_json(message)
    return (f'{{"id":{job_id:d},"lease_token":"{lease_token}","fraction":{fraction!r},"message":{text},'
            f'"data":{data_json}}}')


def _outcome(obj: Any, maybe_nul: bool) -> Done | Failed:
    """A done or failed object, alone or inside ``results``."""
    kind = obj.get("type") if isinstance(obj, dict) else None
    fields = _OUTCOME_FIELDS.get(kind) if isinstance(kind, str) else None
    if fields is None:
        raise ProtocolError(BAD_MESSAGE, "each outcome must be a done or failed message")
    if obj.keys() != fields:
        _exact_fields(obj, fields, fatal=False)
    if kind == "done":
        # PostgreSQL's jsonb cannot store U+0000: refuse it here, not in a batch write.
        if maybe_nul and contains_nul(obj["result"]):
            raise ProtocolError(BAD_MESSAGE, "done.result must not contain the character U+0000")
        return Done(_job_id(obj["id"]), _token(obj["lease_token"]), obj["result"])
    error = obj["error"]
    if not isinstance(error, str):
        raise ProtocolError(BAD_MESSAGE, "failed.error must be a string")
    if not isinstance(obj["retryable"], bool):
        raise ProtocolError(BAD_MESSAGE, "failed.retryable must be true or false")
    return Failed(_job_id(obj["id"]), _token(obj["lease_token"]),
                  error[:MAX_ERROR_TEXT].replace("\x00", "\ufffd"), obj["retryable"])


def contains_nul(value: Any) -> bool:
    """Whether a JSON value holds U+0000 in any string (keys too): jsonb refuses it."""
    if isinstance(value, str):
        return "\x00" in value
    if isinstance(value, list):
        return any(contains_nul(v) for v in value)
    if isinstance(value, dict):
        return any("\x00" in k or contains_nul(v) for k, v in value.items())
    return False


def pack_results(items: list[str], max_size: int, started: tuple[int, ...] = ()) -> list[str]:
    """Frames of ``results`` from encoded outcomes (``encode(Done(...))``), each within ``max_size``;
    ``started`` ids (protocol 5) ride in the first (a ``started`` frame when there is no outcome).

    An item too large for a frame of its own is the caller's to refuse first.
    """
    if not started:
        return _pack(_RESULTS_HEAD, items, max_size)
    ids = ",".join(map(str, started))
    if not items:
        return ['{"type":"started","ids":[' + ids + "]}"]
    return _pack(_RESULTS_HEAD, items, max_size, '{"type":"results","started":[' + ids + '],"results":[')


def pack_progress(items: list[str], max_size: int) -> list[str]:
    """Frames of ``progress`` from encoded updates (``progress_item``), each within ``max_size``."""
    return _pack(_PROGRESS_HEAD, items, max_size)


def _pack(head: str, items: list[str], max_size: int, first_head: str | None = None) -> list[str]:
    """``head`` (``first_head`` for the first frame) + comma-joined items + ``]}``, in as few frames
    of at most ``MAX_RESULTS`` items as fit."""
    frames: list[str] = []
    this = first_head or head
    start, size = 0, len(this) + len(_RESULTS_TAIL)
    for i, item in enumerate(items):
        if i > start and (size + len(item) + 1 > max_size or i - start >= MAX_RESULTS):
            frames.append(this + ",".join(items[start:i]) + _RESULTS_TAIL)
            this = head
            start, size = i, len(head) + len(_RESULTS_TAIL)
        size += len(item) + 1
    if start < len(items):
        frames.append(this + ",".join(items[start:]) + _RESULTS_TAIL)
    return frames


def jobs_frame(messages: list[str]) -> str:
    """A ``jobs`` frame from jobs already encoded as JSON objects (``job_message``)."""
    return '{"type":"jobs","jobs":[' + ",".join(messages) + "]}"


def job_message(job_id: int, lease_token: str, kind: str, payload_json: str, attempt: int,
                timeout: int | None = None, devices: tuple[int, ...] = (), queued_ms: int | None = None) -> str:
    """One pushed job, as JSON, around a payload that is JSON text already (from PostgreSQL).

    Spliced, not encoded: the lease token is PostgreSQL's uuid text and the
    kind matches the table's CHECK (``gpuq.kinds``: letters, digits, ``_.:/-``), so
    neither needs escaping. Spliced here rather than built by the lease statement
    (json_build_object): see docs/design.md, "The push".
    """
    limit = "" if timeout is None else f',"timeout":{timeout:d}'
    if devices:
        limit += ',"devices":[' + ",".join(map(str, devices)) + "]"
    if queued_ms is not None:
        limit += f',"queued_ms":{max(0, queued_ms):d}'
    return (f'{{"id":{job_id:d},"lease_token":"{lease_token}","kind":"{kind}","payload":{payload_json},'
            f'"attempt":{attempt:d}{limit}}}')


_RESULTS_HEAD, _RESULTS_TAIL = '{"type":"results","results":[', "]}"
_PROGRESS_HEAD = '{"type":"progress","updates":['
RESULTS_OVERHEAD = len(_RESULTS_HEAD) + len(_RESULTS_TAIL)  # bytes a one-item frame adds to its item


def _hello_version(obj: dict[str, Any]) -> int:
    """The hello's protocol version, checked first: its fields depend on it."""
    version = obj.get("protocol")
    if version not in SUPPORTED_VERSIONS or not _is_int(version):
        raise ProtocolError(BAD_MESSAGE, f"protocol {str(version)[:40]!r} is not supported; this server speaks "
                            f"{', '.join(map(str, SUPPORTED_VERSIONS))}", fatal=True,
                            close=CloseCode.UNSUPPORTED_VERSION)
    return int(version)


def _hello(obj: dict[str, Any]) -> Hello:
    version = obj["protocol"]
    agent, kinds, capacity = obj["agent"], obj["kinds"], obj["capacity"]
    if not isinstance(agent, str) or not AGENT_NAME.fullmatch(agent):
        raise ProtocolError(BAD_MESSAGE, "hello.agent must be 1-64 characters of A-Z a-z 0-9 _ . : @ -",
                            fatal=True)
    if (not isinstance(kinds, list) or not 1 <= len(kinds) <= MAX_KINDS
            or not all(is_kind(k) for k in kinds)):
        raise ProtocolError(BAD_MESSAGE, f"hello.kinds must be a list of 1-{MAX_KINDS} job kinds "
                            f"({KIND_RULE})", fatal=True)
    if not _is_int(capacity) or not 1 <= capacity <= MAX_CAPACITY:
        raise ProtocolError(BAD_MESSAGE, f"hello.capacity must be an integer 1-{MAX_CAPACITY}", fatal=True)
    if version < PLACEMENT_SINCE:
        return Hello(agent, tuple(dict.fromkeys(kinds)), capacity, version)
    prefetch = obj.get("prefetch", 0)
    if not _is_int(prefetch) or not 0 <= prefetch <= MAX_PREFETCH:
        raise ProtocolError(BAD_MESSAGE, f"hello.prefetch must be an integer 0-{MAX_PREFETCH}", fatal=True)
    return Hello(agent, tuple(dict.fromkeys(kinds)), capacity, version, devices_from(obj["devices"]),
                 check_labels(obj["labels"], "hello.labels", fatal=True),
                 check_models(obj["models"], "hello.models", fatal=True), prefetch)


# --------------------------------------------------------------------------
# Messages from the server
# --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Welcome:
    agent_id: str  # this connection's id: the jobs' leased_by
    lease_seconds: float
    heartbeat_seconds: float
    max_payload: int
    protocol: int = PROTOCOL_VERSION


@dataclass(frozen=True, slots=True)
class JobMessage:
    """A job pushed to the agent: what its handler gets.

    ``cancelled`` turns true when the server cancels the job (``gpuq cancel``):
    a sync handler checks it and returns early; an async one is cancelled.
    ``progress()`` reports how far it has got.
    """

    id: int
    lease_token: str
    kind: str
    payload: Any
    attempt: int
    timeout: float | None = None  # seconds this attempt may run (protocol 2); the agent stops it then
    devices: tuple[int, ...] = ()  # the device indices this job was given (protocol 4; GPU jobs only)
    queued_ms: int | None = None  # how long it had been due when leased (protocol 6)
    cancelled: bool = field(default=False, compare=False)
    # Where progress() sends an encoded update (the agent sets it); None: nowhere.
    reporter: Callable[[int, str], None] | None = field(default=None, compare=False, repr=False)

    def progress(self, fraction: float, message: str | None = None, data: Any = None) -> None:
        """Report how far this job has got: ``fraction`` from 0 to 1, an optional message (cut to
        1024 characters) and any JSON ``data`` (up to 8 KiB). Call it as often as you like, from
        any thread: the agent keeps only the latest and sends it at most twice a second, and the
        server writes it at most once a second. ``ValueError`` for a bad value."""
        item = progress_item(self.id, self.lease_token, fraction, message, data)
        if self.reporter is not None:
            self.reporter(self.id, item)


def mark_cancelled(job: JobMessage) -> None:
    """Set ``job.cancelled``: the one field of a pushed job that changes (server cancel, or its timeout)."""
    object.__setattr__(job, "cancelled", True)


def attach_reporter(job: JobMessage, reporter: Callable[[int, str], None]) -> None:
    """Where ``job.progress()`` sends its updates (the agent's side of the connection)."""
    object.__setattr__(job, "reporter", reporter)


@dataclass(frozen=True, slots=True)
class Jobs:
    jobs: tuple[JobMessage, ...]


@dataclass(frozen=True, slots=True)
class Ack:
    """Outcomes persisted (committed) by the server, and those fencing refused."""

    accepted: tuple[int, ...]
    rejected: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ServerDrain:
    """From the server: no more jobs will come; finish, report, then reconnect."""

    deadline_seconds: float


@dataclass(frozen=True, slots=True)
class Error:
    code: str
    message: str


@dataclass(frozen=True, slots=True)
class Cancel:
    """From the server (protocol 2): these jobs of yours were cancelled; stop their handlers.
    Their outcome, if any is sent, will be refused by fencing."""

    ids: tuple[int, ...]


ServerMessage = Welcome | Jobs | Ack | ServerDrain | Error | Cancel


def encode(msg: ServerMessage | ClientMessage) -> str:
    """One JSON text frame for any message."""
    body: dict[str, Any]
    if isinstance(msg, Done):  # the per-job messages first
        return encode_done(msg.id, msg.lease_token, msg.result)
    if isinstance(msg, Ack):
        body = {"type": "ack", "accepted": list(msg.accepted), "rejected": list(msg.rejected)}
    elif isinstance(msg, Failed):
        body = {"type": "failed", "id": msg.id, "lease_token": msg.lease_token, "error": msg.error,
                "retryable": msg.retryable}
    elif isinstance(msg, Results):
        return pack_results([encode(o) for o in msg.outcomes], 1 << 62, msg.started)[0]
    elif isinstance(msg, Started | Release):
        body = {"type": "started" if isinstance(msg, Started) else "release", "ids": list(msg.ids)}
    elif isinstance(msg, Jobs):
        body = {"type": "jobs", "jobs": [
            {"id": j.id, "lease_token": j.lease_token, "kind": j.kind, "payload": j.payload,
             "attempt": j.attempt, **({} if j.timeout is None else {"timeout": int(j.timeout)}),
             **({"devices": list(j.devices)} if j.devices else {}),
             **({} if j.queued_ms is None else {"queued_ms": j.queued_ms})}
            for j in msg.jobs]}
    elif isinstance(msg, Welcome):
        body = {"type": "welcome", "agent_id": msg.agent_id, "protocol": msg.protocol,
                "lease_seconds": msg.lease_seconds,
                "heartbeat_seconds": msg.heartbeat_seconds, "max_payload": msg.max_payload}
    elif isinstance(msg, ServerDrain):
        body = {"type": "drain", "deadline_seconds": msg.deadline_seconds}
    elif isinstance(msg, Cancel):
        body = {"type": "cancel", "ids": list(msg.ids)}
    elif isinstance(msg, Error):
        body = {"type": "error", "code": msg.code, "message": msg.message}
    elif isinstance(msg, Hello):
        body = {"type": "hello", "agent": msg.agent, "kinds": list(msg.kinds), "capacity": msg.capacity,
                "protocol": msg.protocol}
        if msg.protocol >= PLACEMENT_SINCE:
            body.update(devices=[device_json(d) for d in msg.devices], labels=list(msg.labels),
                        models=list(msg.models))
        if msg.protocol >= PREFETCH_SINCE:
            body["prefetch"] = msg.prefetch
    elif isinstance(msg, Heartbeat):
        body = {"type": "heartbeat", "ids": list(msg.ids)}
        if msg.devices is not None:
            body["devices"] = [usage_json(u) for u in msg.devices]
        if msg.slots is not None:
            body["slots"] = slots_json(msg.slots)
    elif isinstance(msg, Update):
        body = {"type": "update", "labels": None if msg.labels is None else list(msg.labels),
                "models": None if msg.models is None else list(msg.models)}
    elif isinstance(msg, Drain):
        body = {"type": "drain"}
    elif isinstance(msg, Progress):
        return pack_progress([progress_item(u.id, u.lease_token, u.fraction, u.message, u.data)
                              for u in msg.updates], 1 << 62)[0]
    else:  # pragma: no cover - a programming error, not input
        raise TypeError(f"not a protocol message: {msg!r}")
    return _to_json(body)


def encode_done(job_id: int, lease_token: str, result: Any) -> str:
    """``encode(Done(...))`` without building the object or a dict: the message an agent sends per job."""
    return f'{{"type":"done","id":{job_id:d},"lease_token":{_to_json(lease_token)},"result":{_to_json(result)}}}'


# One encoder for every frame: json.dumps with any option builds a new one per call.
_to_json = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode


def parse_server(frame: str | bytes) -> ServerMessage:
    """Parse one frame from the server (the agent side); ``ProtocolError`` if malformed."""
    if isinstance(frame, bytes):
        raise ProtocolError(BAD_MESSAGE, "binary frame from the server")
    obj = _load(frame)
    kind = obj.get("type")
    try:
        if kind == "welcome":
            return Welcome(str(obj["agent_id"]), float(obj["lease_seconds"]),
                           float(obj["heartbeat_seconds"]), int(obj["max_payload"]), int(obj["protocol"]))
        if kind == "jobs":
            return Jobs(tuple(JobMessage(_job_id(j["id"]), _token(j["lease_token"]), str(j["kind"]),
                                         j["payload"], int(j["attempt"]), _timeout(j.get("timeout")),
                                         _devices(j.get("devices")), _queued(j.get("queued_ms")))
                              for j in obj["jobs"]))
        if kind == "ack":
            return Ack(tuple(_job_id(i) for i in obj["accepted"]), tuple(_job_id(i) for i in obj["rejected"]))
        if kind == "drain":
            return ServerDrain(float(obj["deadline_seconds"]))
        if kind == "error":
            return Error(str(obj["code"]), str(obj["message"]))
        if kind == "cancel":
            ids = obj["ids"]
            if not isinstance(ids, list) or len(ids) > MAX_CANCEL_IDS:
                raise ValueError(f"cancel.ids must be a list of at most {MAX_CANCEL_IDS} job ids")
            return Cancel(tuple(_job_id(i) for i in ids))
    except (KeyError, TypeError, ValueError) as exc:
        raise ProtocolError(BAD_MESSAGE, f"malformed {kind} message from the server: {exc}") from None
    raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"unknown message type {kind!r} from the server")


# --------------------------------------------------------------------------
# Field checks
# --------------------------------------------------------------------------


def _load(frame: str) -> dict[str, Any]:
    try:
        obj = _DECODER.decode(frame)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(ErrorCode.BAD_JSON, f"frame is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_MESSAGE, "a message must be a JSON object with a 'type' field")
    return obj


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_DECODER = json.JSONDecoder(parse_constant=_no_constants)  # one, not one per frame


def _exact_fields(obj: dict[str, Any], fields: set[str], fatal: bool) -> None:
    missing, extra = fields - obj.keys(), obj.keys() - fields
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(sorted(missing))}")
        if extra:
            parts.append(f"unexpected {', '.join(sorted(map(str, extra)))[:200]}")
        raise ProtocolError(BAD_MESSAGE, f"{obj['type']}: {'; '.join(parts)}", fatal=fatal)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _timeout(value: Any) -> float | None:
    if value is None:
        return None
    if not _is_int(value) or value < 1:
        raise ValueError(f"job timeout must be a positive integer, not {str(value)[:40]!r}")
    return float(value)


def _queued(value: Any) -> int | None:
    if value is not None and (type(value) is not int or value < 0):
        raise ValueError(f"job queued_ms must be a whole number of ms, not {str(value)[:40]!r}")
    return value


def _devices(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(_is_int(i) and 0 <= i <= 255 for i in value):
        raise ValueError(f"job devices must be a list of device indices, not {str(value)[:40]!r}")
    return tuple(value)


def _job_id(value: Any) -> int:
    if type(value) is int and 0 < value <= MAX_JOB_ID:  # JSON gives exact ints (never bool)
        return value
    raise ProtocolError(BAD_MESSAGE, f"job id must be a positive 64-bit integer, not {str(value)[:40]!r}")


_CANONICAL_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _token(value: Any) -> str:
    if not isinstance(value, str):
        raise ProtocolError(BAD_MESSAGE, "lease_token must be a string")
    if _CANONICAL_UUID.fullmatch(value):  # as we sent it: the common case, without a UUID object
        return value
    try:
        return str(uuid.UUID(value))
    except ValueError:
        raise ProtocolError(BAD_MESSAGE, f"lease_token {value[:40]!r} is not a UUID") from None
