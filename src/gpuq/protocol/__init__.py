"""The agent protocol, without I/O (docs/protocol.md).

- ``codes``: version, limits, ``CloseCode``, ``ErrorCode``, ``ProtocolError``;
- ``messages``: the message types, strict parsing and encoding;
- ``server_side``: ``ServerProtocol``, one agent connection as the server sees it;
- ``agent_side``: ``AgentProtocol``, the agent's side across reconnects.

``gpuq.server`` and ``gpuq.agent`` only pump frames through these. Nothing
here imports the database side.
"""

from gpuq.protocol.codes import (
    MAX_CAPACITY,
    MAX_ERROR_TEXT,
    MAX_HEARTBEAT_IDS,
    MAX_JOB_ID,
    MAX_KINDS,
    MAX_RESULTS,
    PROTOCOL_VERSION,
    CloseCode,
    ErrorCode,
    ProtocolError,
)
from gpuq.protocol.messages import (
    AGENT_NAME,
    RESULTS_OVERHEAD,
    Ack,
    ClientMessage,
    Done,
    Drain,
    Error,
    Failed,
    Heartbeat,
    Hello,
    JobMessage,
    Jobs,
    Results,
    ServerDrain,
    ServerMessage,
    Welcome,
    contains_nul,
    encode,
    encode_done,
    job_message,
    jobs_frame,
    pack_results,
    parse_client,
    parse_server,
)

__all__ = [
    "AGENT_NAME", "MAX_CAPACITY", "MAX_ERROR_TEXT", "MAX_HEARTBEAT_IDS", "MAX_JOB_ID", "MAX_KINDS",
    "MAX_RESULTS", "PROTOCOL_VERSION", "RESULTS_OVERHEAD", "Ack", "ClientMessage", "CloseCode", "Done",
    "Drain", "Error", "ErrorCode", "Failed", "Heartbeat", "Hello", "JobMessage", "Jobs", "ProtocolError",
    "Results", "ServerDrain", "ServerMessage", "Welcome", "contains_nul", "encode", "encode_done",
    "job_message", "jobs_frame", "pack_results", "parse_client", "parse_server",
]
