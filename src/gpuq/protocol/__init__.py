"""The agent protocol, without I/O (docs/protocol.md).

- ``codes``: version, limits, ``CloseCode``, ``ErrorCode``, ``ProtocolError``;
- ``describe``: what an agent says about itself (devices, labels, models, usage);
- ``messages``: the message types, strict parsing and encoding;
- ``slots``: how busy an agent's slots keep (its count, its reports, the server's window);
- ``server_side``: ``ServerProtocol``, one agent connection as the server sees it;
- ``agent_side``: ``AgentProtocol``, the agent's side across reconnects.

``gpuq.server`` and ``gpuq.agent`` only pump frames through these. Nothing
here imports the database side.
"""

from gpuq.protocol import codes, describe, messages
from gpuq.protocol.codes import *  # noqa: F403 - the package's names are its modules' __all__
from gpuq.protocol.describe import *  # noqa: F403
from gpuq.protocol.messages import *  # noqa: F403

__all__ = [*codes.__all__, *describe.__all__, *messages.__all__]
