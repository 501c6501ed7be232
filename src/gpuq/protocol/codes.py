"""The protocol's version, limits, close codes and error codes (docs/protocol.md)."""

from __future__ import annotations

from enum import IntEnum, StrEnum

__all__ = ["BATCH_SINCE", "CHECKPOINT_SINCE", "MAX_CHECKPOINT_DATA", "MAX_PREEMPT_SECONDS", "PREEMPT_SINCE", "MAX_TRACESTATE", "TRACE_SINCE", "CANCEL_SINCE", "MAX_BATCH_ITEMS", "MAX_CAPACITY", "MAX_CANCEL_IDS", "MAX_ERROR_TEXT", "MAX_HEARTBEAT_IDS", "MAX_JOB_ID",
           "MAX_KINDS", "MAX_PROGRESS_DATA", "MAX_PROGRESS_MESSAGE", "MAX_RESULTS", "PLACEMENT_SINCE", "QUARANTINE_SINCE", "MAX_FAULT_ERROR", "PREFETCH_SINCE", "MAX_PREFETCH", "PROGRESS_SINCE",
           "PROTOCOL_VERSION", "SLOTS_SINCE", "SUPPORTED_VERSIONS", "CloseCode", "ErrorCode", "ProtocolError"]

PROTOCOL_VERSION = 9  # what this side speaks
SUPPORTED_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8, 9)  # what a server accepts in a hello; it answers in the agent's version
CANCEL_SINCE = 2  # the first version with the server's ``cancel`` message
PROGRESS_SINCE = 3  # the first version with the agent's ``progress`` message
PLACEMENT_SINCE = 4  # devices, labels and models in ``hello``; ``update``; device usage in heartbeats
PREFETCH_SINCE = 5  # ``prefetch`` in ``hello``; ``started`` and ``release``; ``results.started``
MAX_PREFETCH = 1024
# ``queued_ms`` in jobs; ``slots`` (busy time, gaps) in heartbeats; a job may come for busy devices
SLOTS_SINCE = 6
# ``batch`` in ``hello`` (jobs one batch handler call takes) and in pushed jobs (the batch they belong to)
BATCH_SINCE = 7
MAX_BATCH_ITEMS = 4096
# ``traceparent`` and ``tracestate`` in pushed jobs: the producer's trace (W3C), when the job has one
TRACE_SINCE = 8
MAX_TRACESTATE = 512  # characters (W3C's limit; the jobs table's CHECK)
# ``device_fault`` (agent -> server): a device is bad (the handler's DeviceError, an Xid or ECC error)
QUARANTINE_SINCE = 9
MAX_FAULT_ERROR = 1024  # characters of a fault's error kept (cut, not refused)
# ``checkpoint`` (agent) and ``checkpointed`` (server); ``resume_from`` in pushed jobs
CHECKPOINT_SINCE = 9
MAX_CHECKPOINT_DATA = 8192  # bytes of a checkpoint's data as JSON: more is refused
# ``preempt`` (server -> agent: yield these jobs by a deadline) and ``preempted`` outcomes (agent -> server);
# only an agent of this version is given preemptible jobs
PREEMPT_SINCE = 9
MAX_PREEMPT_SECONDS = 86400.0  # the longest deadline a ``preempt`` may give

MAX_KINDS = 64
MAX_CAPACITY = 4096
MAX_ERROR_TEXT = 8192
MAX_HEARTBEAT_IDS = 4096
MAX_JOB_ID = 2**63 - 1
MAX_RESULTS = 4096  # outcomes in one ``results`` message
MAX_CANCEL_IDS = 4096  # job ids in one ``cancel`` message
MAX_PROGRESS_MESSAGE = 1024  # characters of a progress message kept (like error text, cut, not refused)
MAX_PROGRESS_DATA = 8192  # bytes of a progress update's ``data`` as JSON: more is refused


class CloseCode(IntEnum):
    """Websocket close codes; 4000-4999 are the application's own range."""

    NORMAL = 1000
    GOING_AWAY = 1001  # server shutting down: reconnect (to another replica)
    UNSUPPORTED_DATA = 1003  # binary frame
    TOO_BIG = 1009  # frame over the size limit (sent by the websocket layer)
    PROTOCOL_ERROR = 4000  # bad or missing hello, a fatal error, or too many errors
    HELLO_TIMEOUT = 4002  # no hello within the deadline
    UNSUPPORTED_VERSION = 4003
    RATE_LIMITED = 4008


class ErrorCode(StrEnum):
    """The ``code`` of an ``error`` message: the frame was refused, the connection goes on."""

    BAD_JSON = "bad_json"
    BAD_MESSAGE = "bad_message"  # not an object, missing/extra field, wrong type, out of range
    UNKNOWN_TYPE = "unknown_type"
    UNEXPECTED = "unexpected"  # a valid message at the wrong time (a second hello)
    TOO_LARGE = "too_large"
    NOT_HELD = "not_held"  # a heartbeat for a job this connection does not hold


class ProtocolError(Exception):
    """A refused frame. ``fatal``: the connection must close, with ``close`` where the
    error itself decides the code (a binary frame, an unsupported version)."""

    def __init__(self, code: ErrorCode, message: str, fatal: bool = False,
                 close: CloseCode = CloseCode.PROTOCOL_ERROR):
        super().__init__(message)
        self.code = code
        self.message = message
        self.fatal = fatal
        self.close = close
