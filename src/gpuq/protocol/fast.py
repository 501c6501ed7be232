"""The fast path of the two hottest frames: msgspec decoders, never an error of their own.

An agent's ``results`` (and a lone ``done``, ``failed`` or ``preempted``) and
the server's ``jobs`` are decoded by typed msgspec decoders in a third or less
of the time ``json`` and ``parse``'s field checks take (building the message
objects costs what it did: most of a ``jobs`` frame's). The rule: a decoder
here returns the message ``parse``'s strict path would build from that frame,
equal in every field, or None, and then ``parse`` runs its own path, which
gives the error, code and close. So each type below is at least as strict as
``parse``: strict types (no bool for an int, no 1.0), every field known, ids in
range, a lease token only in its canonical form; a frame with ``\\u0000`` (a
``done.result`` must not hold U+0000), a number ``json`` reads and msgspec does
not (1e400) or JSON nested deeper than ``MAX_NESTING`` goes ``parse``'s way.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from gpuq.protocol import messages as m
from gpuq.protocol.codes import (
    MAX_ERROR_TEXT,
    MAX_HEARTBEAT_IDS,
    MAX_JOB_ID,
    MAX_PREEMPT_SECONDS,
    MAX_RESULTS,
    MAX_TRACESTATE,
)

__all__ = ["MAX_NESTING", "client_message", "server_jobs"]

# JSON nesting (within a result, a payload) this path takes: a deeper frame is parsed by ``json``,
# whose recursion limit says where it stops (msgspec's lies a few levels deeper).
MAX_NESTING = 200

JobId = Annotated[int, msgspec.Meta(ge=1, le=MAX_JOB_ID)]
# A lease token's length here; its form (``_canonical``) for the whole frame at once: a pattern
# here costs a regex call per token, four times this path's decoding.
Token = Annotated[str, msgspec.Meta(min_length=36, max_length=36)]
TraceText = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TRACESTATE)]


class _Outcome(msgspec.Struct, tag_field="type", forbid_unknown_fields=True, gc=False):
    id: JobId
    lease_token: Token


class _Done(_Outcome, tag="done"):
    result: Any


class _Failed(_Outcome, tag="failed"):
    error: str
    retryable: bool


class _Preempted(_Outcome, tag="preempted"):
    pass


class _Results(msgspec.Struct, tag_field="type", tag="results", forbid_unknown_fields=True, gc=False):
    results: Annotated[list[_Done | _Failed | _Preempted], msgspec.Meta(min_length=1, max_length=MAX_RESULTS)]
    started: Annotated[list[JobId], msgspec.Meta(max_length=MAX_HEARTBEAT_IDS)] = []


_CLIENT = msgspec.json.Decoder(_Results | _Done | _Failed | _Preempted)


def client_message(frame: str) -> m.Results | m.Outcome | None:
    """An agent's ``results``, ``done``, ``failed`` or ``preempted`` frame as ``parse`` reads it, or None."""
    if "\\u0000" in frame:
        return None
    try:
        msg = _CLIENT.decode(frame)
    except (ValueError, RecursionError):  # msgspec's errors, and text that is not UTF-8
        return None
    if type(msg) is not _Results:
        return _outcome(msg) if _canonical([msg.lease_token]) and _shallow(frame, 1, (msg,)) else None
    if not _canonical([o.lease_token for o in msg.results]) or not _shallow(frame, 2 + len(msg.results), msg.results):
        return None
    return m.Results(tuple([_outcome(o) for o in msg.results]), tuple(msg.started))


def _outcome(o: _Done | _Failed | _Preempted) -> m.Outcome:
    if type(o) is _Done:
        return m.Done(o.id, o.lease_token, o.result)
    if type(o) is _Failed:  # the text kept as parse keeps it
        return m.Failed(o.id, o.lease_token, o.error[:MAX_ERROR_TEXT].replace("\x00", "\ufffd"), o.retryable)
    return m.Preempted(o.id, o.lease_token)


class _Job(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    id: JobId
    lease_token: Token
    kind: str
    payload: Any
    attempt: int
    timeout: Annotated[int, msgspec.Meta(ge=1, le=MAX_JOB_ID)] | None = None  # float() of it never overflows
    devices: list[Annotated[int, msgspec.Meta(ge=0, le=255)]] | None = None
    queued_ms: Annotated[int, msgspec.Meta(ge=0)] | None = None
    batch: JobId | None = None
    traceparent: TraceText | msgspec.UnsetType = msgspec.UNSET
    tracestate: TraceText | None = None
    resume_from: Any = None
    grace_seconds: Annotated[float, msgspec.Meta(gt=0, le=MAX_PREEMPT_SECONDS)] | None = None

    def message(self) -> m.JobMessage:
        trace = None if self.traceparent is msgspec.UNSET else (self.traceparent, self.tracestate)
        return m.JobMessage(self.id, self.lease_token, self.kind, self.payload, self.attempt,
                            None if self.timeout is None else float(self.timeout),
                            () if self.devices is None else tuple(self.devices), self.queued_ms, self.batch,
                            trace, self.resume_from, None if self.grace_seconds is None else float(self.grace_seconds))


class _Jobs(msgspec.Struct, forbid_unknown_fields=True, gc=False):
    type: Literal["jobs"]  # a field, not a tag: a tag is optional but in a union
    jobs: list[_Job]


_JOBS = msgspec.json.Decoder(_Jobs)


def server_jobs(frame: str) -> m.Jobs | None:
    """The server's ``jobs`` frame as ``parse`` reads it, or None."""
    try:
        msg = _JOBS.decode(frame)
    except (ValueError, RecursionError):
        return None
    if (not _canonical([j.lease_token for j in msg.jobs])
            or not _shallow(frame, 2 + len(msg.jobs), [v for j in msg.jobs for v in (j.payload, j.resume_from)])):
        return None
    return m.Jobs(tuple([j.message() for j in msg.jobs]))


_HEX_OR_DASH = b"0123456789abcdef-"


def _canonical(tokens: list[str]) -> bool:
    """Whether each token (36 characters) is a UUID as ``str(uuid.UUID(...))`` writes it: lowercase
    hex with a dash at 8, 13, 18 and 23 and nowhere else. ``fields.token`` takes other spellings too
    (it canonicalizes them): those frames are parse's."""
    text = "".join(tokens)
    if not text.isascii():
        return False
    data, n = text.encode(), len(tokens)
    return (not data.translate(None, _HEX_OR_DASH) and data.count(b"-") == 4 * n
            and data[8::36] == data[13::36] == data[18::36] == data[23::36] == b"-" * n)


def _shallow(frame: str, brackets: int, values: Any) -> bool:
    """Whether the JSON values (``_Done`` for their results) nest at most ``MAX_NESTING`` deep.

    ``brackets`` of the frame are its own (its object, its list, an object per item): when the rest
    are fewer than ``MAX_NESTING``, no value can nest deeper, and nothing is walked.
    """
    if frame.count("[") + frame.count("{") - brackets <= MAX_NESTING:
        return True
    stack = [(v.result if type(v) is _Done else v, 1) for v in values]
    while stack:
        value, depth = stack.pop()
        if type(value) is dict:
            value = list(value.values())
        elif type(value) is not list:
            continue
        if depth > MAX_NESTING:
            return False
        stack.extend((v, depth + 1) for v in value)
    return True
