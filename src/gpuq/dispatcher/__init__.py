"""The dispatcher: small parts around one loop, each owning its state.

- ``loop``: ``Dispatcher``, the loop (wait for a reason, run a pass, deliver,
  drain) and the agents' events;
- ``wakeups``: every reason to lease (LISTEN, the wake-up mark, stragglers,
  freed credit, polls) gathered into one ``Pass``;
- ``groups``: plain jobs leased per group of agents taking the same kinds;
- ``cursors``: lease cursors, the settled horizon and floors (pure);
- ``placing``: placed jobs shape by shape (shapes and limits, warm waits,
  reservations); the rules themselves are ``gpuq.placement``;
- ``sessions``: the connected agents;
- ``completer``, ``heartbeats``, ``progress``: what agents report, written in
  the background in batches;
- ``tuning``: the timing knobs, as named defaults.
"""

from gpuq.dispatcher.loop import Dispatcher
from gpuq.dispatcher.sessions import AgentSession
from gpuq.dispatcher.tuning import Tuning

__all__ = ["AgentSession", "Dispatcher", "Tuning"]
