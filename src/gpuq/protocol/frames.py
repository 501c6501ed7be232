"""Encoding: messages to JSON text frames, the fast encoders that splice, and frame packing.

``encode`` writes any message as one frame. The hot paths do not build a
message object or a dict: ``encode_done`` (an agent, per job; ``done_or_failed``
turns a result the server could not take into a permanent ``failed``),
``job_message`` and ``jobs_frame`` (the server's push, around payloads that
are JSON text already) and ``progress_item`` (``fields``). ``pack_results``
and ``pack_progress`` put many encoded items into as few frames as fit a
size; ``fault_frame`` keeps a device fault to the devices the hello named.
Every frame here parses back (``parse``) to what was encoded.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gpuq.protocol import messages as m
from gpuq.protocol.codes import (
    BATCH_SINCE,
    MAX_FAULT_ERROR,
    MAX_RESULTS,
    PLACEMENT_SINCE,
    PREFETCH_SINCE,
)
from gpuq.protocol.describe import device_json, usage_json
from gpuq.protocol.fields import checkpoint_item, contains_nul, progress_item, to_json
from gpuq.protocol.slots import slots_json

__all__ = ["RESULTS_OVERHEAD", "encode", "done_or_failed", "encode_done", "fault_frame", "job_message", "jobs_frame", "pack_checkpoints", "pack_progress",
           "pack_results"]

_RESULTS_HEAD, _RESULTS_TAIL = '{"type":"results","results":[', "]}"
_PROGRESS_HEAD = '{"type":"progress","updates":['
_CHECKPOINT_HEAD = '{"type":"checkpoint","checkpoints":['
RESULTS_OVERHEAD = len(_RESULTS_HEAD) + len(_RESULTS_TAIL)  # bytes a one-item frame adds to its item


def encode(msg: m.ServerMessage | m.ClientMessage) -> str:
    """One JSON text frame for any message but ``Jobs``: the server pushes jobs with ``jobs_frame``."""
    body: dict[str, Any]
    if isinstance(msg, m.Done):  # the per-job messages first
        return encode_done(msg.id, msg.lease_token, msg.result)
    if isinstance(msg, m.Ack):
        body = {"type": "ack", "accepted": list(msg.accepted), "rejected": list(msg.rejected)}
    elif isinstance(msg, m.Failed):
        body = {"type": "failed", "id": msg.id, "lease_token": msg.lease_token, "error": msg.error,
                "retryable": msg.retryable}
    elif isinstance(msg, m.Results):
        return pack_results([encode(o) for o in msg.outcomes], 1 << 62, msg.started)[0]
    elif isinstance(msg, m.Started | m.Release):
        body = {"type": "started" if isinstance(msg, m.Started) else "release", "ids": list(msg.ids)}
    elif isinstance(msg, m.Welcome):
        body = {"type": "welcome", "agent_id": msg.agent_id, "protocol": msg.protocol,
                "lease_seconds": msg.lease_seconds,
                "heartbeat_seconds": msg.heartbeat_seconds, "max_payload": msg.max_payload}
    elif isinstance(msg, m.ServerDrain):
        body = {"type": "drain", "deadline_seconds": msg.deadline_seconds}
    elif isinstance(msg, m.Preempted):
        body = {"type": "preempted", "id": msg.id, "lease_token": msg.lease_token}
    elif isinstance(msg, m.Cancel):
        body = {"type": "cancel", "ids": list(msg.ids)}
    elif isinstance(msg, m.Preempt):
        body = {"type": "preempt", "ids": list(msg.ids), "deadline_seconds": msg.deadline_seconds}
    elif isinstance(msg, m.Error):
        body = {"type": "error", "code": msg.code, "message": msg.message}
    elif isinstance(msg, m.Hello):
        body = _hello(msg)
    elif isinstance(msg, m.Heartbeat):
        body = {"type": "heartbeat", "ids": list(msg.ids)}
        if msg.devices is not None:
            body["devices"] = [usage_json(u) for u in msg.devices]
        if msg.slots is not None:
            body["slots"] = slots_json(msg.slots)
    elif isinstance(msg, m.Update):
        body = {"type": "update", "labels": None if msg.labels is None else list(msg.labels),
                "models": None if msg.models is None else list(msg.models)}
    elif isinstance(msg, m.Drain):
        body = {"type": "drain"}
    elif isinstance(msg, m.DeviceFault):
        body = {"type": "device_fault", "devices": list(msg.devices), "source": msg.source, "error": msg.error,
                "job": msg.job}
    elif isinstance(msg, m.Progress):
        return pack_progress([progress_item(u.id, u.lease_token, u.fraction, u.message, u.data)
                              for u in msg.updates], 1 << 62)[0]
    elif isinstance(msg, m.Checkpoint):
        return pack_checkpoints([checkpoint_item(c.id, c.lease_token, c.seq, to_json(c.data)) for c in msg.items],
                                1 << 62)[0]
    elif isinstance(msg, m.Checkpointed):
        body = {"type": "checkpointed", "stored": list(msg.stored), "refused": list(msg.refused)}
    else:  # pragma: no cover - a programming error (or ``Jobs``), not input
        raise TypeError(f"not a protocol message encode() writes: {msg!r}")
    return to_json(body)


def _hello(msg: m.Hello) -> dict[str, Any]:
    """A hello has the fields of its own version: an older agent's hello stays as it was."""
    body: dict[str, Any] = {"type": "hello", "agent": msg.agent, "kinds": list(msg.kinds),
                            "capacity": msg.capacity, "protocol": msg.protocol}
    if msg.protocol >= PLACEMENT_SINCE:
        body.update(devices=[device_json(d) for d in msg.devices], labels=list(msg.labels),
                    models=list(msg.models))
    if msg.protocol >= PREFETCH_SINCE:
        body["prefetch"] = msg.prefetch
    if msg.protocol >= BATCH_SINCE:
        body["batch"] = msg.batch
    return body


def encode_done(job_id: int, lease_token: str, result: Any) -> str:
    """``encode(Done(...))`` without building the object or a dict: the message an agent sends per job."""
    return f'{{"type":"done","id":{job_id:d},"lease_token":{to_json(lease_token)},"result":{to_json(result)}}}'


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


def pack_checkpoints(items: list[str], max_size: int) -> list[str]:
    """Frames of ``checkpoint`` from encoded checkpoints (``checkpoint_item``), each within ``max_size``."""
    return _pack(_CHECKPOINT_HEAD, items, max_size)


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
                timeout: int | None = None, devices: tuple[int, ...] = (), queued_ms: int | None = None,
                batch: int | None = None, trace: tuple[str, str | None] | None = None,
                resume_json: str | None = None, grace_seconds: float | None = None) -> str:
    """One pushed job, as JSON, around a payload that is JSON text already (from PostgreSQL).

    Spliced, not encoded: the lease token is PostgreSQL's uuid text and the
    kind matches the table's CHECK (``gpuq.kinds``: letters, digits, ``_.:/-``), so
    neither needs escaping; so does a ``traceparent`` (the table's CHECK: hex and
    dashes) of ``trace``, the producer's; its ``tracestate`` is encoded.
    ``resume_json``, the job's checkpoint (protocol 9), is JSON text from PostgreSQL, like the payload.
    Spliced here rather than built by the lease statement (json_build_object):
    see docs/design.md, "The push".
    """
    limit = "" if timeout is None else f',"timeout":{timeout:d}'
    if devices:
        limit += ',"devices":[' + ",".join(map(str, devices)) + "]"
    if queued_ms is not None:
        limit += f',"queued_ms":{max(0, queued_ms):d}'
    if batch is not None:
        limit += f',"batch":{batch:d}'
    if trace is not None:
        limit += f',"traceparent":"{trace[0]}"'
        if trace[1] is not None:
            limit += ',"tracestate":' + to_json(trace[1])
    if resume_json is not None:
        limit += ',"resume_from":' + resume_json
    if grace_seconds is not None:  # protocol 9: a preemptible job
        limit += f',"grace_seconds":{float(grace_seconds)!r}'
    return (f'{{"id":{job_id:d},"lease_token":"{lease_token}","kind":"{kind}","payload":{payload_json},'
            f'"attempt":{attempt:d}{limit}}}')


def fault_frame(hello: m.Hello, devices: Iterable[int], source: str, error: str, job_id: int | None) -> str | None:
    """A ``device_fault`` (``source``: handler, xid or ecc) for those of ``devices`` the hello named
    (None: none of them)."""
    known = {d.index for d in hello.devices}
    mine = tuple(dict.fromkeys(i for i in devices if i in known))
    return encode(m.DeviceFault(mine, source, error[:MAX_FAULT_ERROR], job_id)) if mine else None


def done_or_failed(job_id: int, lease_token: str, result: Any, max_frame: int) -> str:
    """The encoded ``done``, or a permanent ``failed`` for a result the server could not take (not
    JSON, over a ``results`` frame of ``max_frame`` bytes, or with U+0000)."""
    limit = max_frame - RESULTS_OVERHEAD
    try:
        item = encode_done(job_id, lease_token, result)
    except (TypeError, ValueError) as exc:
        return encode(m.Failed(job_id, lease_token, f"result is not JSON-serializable: {exc}", False))
    if len(item) > limit:
        return encode(m.Failed(job_id, lease_token, f"result of {len(item)} bytes is over the server's "
                               f"limit of {limit} bytes", False))
    if "\\u0000" in item and contains_nul(result):
        return encode(m.Failed(job_id, lease_token, "result contains the character U+0000, which "
                               "PostgreSQL cannot store in jsonb", False))
    return item
