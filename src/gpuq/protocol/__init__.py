"""The agent protocol, without I/O (docs/protocol.md).

- ``codes``: version, limits, ``CloseCode``, ``ErrorCode``, ``ProtocolError``;
- ``describe``: what an agent says about itself (devices, labels, models, usage);
- ``messages``: the message types;
- ``fields``: one field's value checked (shared by parsing and the checked encoders);
- ``parse``: frames to messages, strictly (``parse_client``, ``parse_server``);
- ``fast``: msgspec decoders of the hottest frames (``results``, ``jobs``), which ``parse`` tries first;
- ``frames``: messages to frames (``encode``), the fast encoders, frame packing;
- ``slots``: how busy an agent's slots keep (its count, its reports, the server's window);
- ``ledger``: what one agent connection holds and may take (credit, devices, usage);
- ``server_side``: ``ServerProtocol``, the rules of one agent connection as the server sees it;
- ``agent_side``: ``AgentProtocol``, the agent's side across reconnects.

``gpuq.server`` and ``gpuq.agent`` only pump frames through these. Nothing
here imports the database side.
"""

from gpuq.protocol import codes, describe, fields, frames, messages, parse
from gpuq.protocol.codes import *  # noqa: F403 - the package's names are its modules' __all__
from gpuq.protocol.describe import *  # noqa: F403
from gpuq.protocol.fields import *  # noqa: F403
from gpuq.protocol.frames import *  # noqa: F403
from gpuq.protocol.messages import *  # noqa: F403
from gpuq.protocol.parse import *  # noqa: F403

__all__ = [*codes.__all__, *describe.__all__, *messages.__all__, *fields.__all__, *parse.__all__, *frames.__all__]
