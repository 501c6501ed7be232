"""Batches (issue #31, protocol 7) through a real ``Agent`` over a real websocket on 127.0.0.1:
a scripted server pushes a ``jobs`` frame with batches and reads what the agent sends back. The
dispatcher does not form batches yet, so no database is involved."""

from __future__ import annotations

import json
import threading
from typing import Any

import anyio
import pytest
from websockets.asyncio.server import serve

from gpuq.agent import Agent, PermanentError
from gpuq.harness import TOKEN
from gpuq.protocol import PROTOCOL_VERSION
from tests.helpers import wait_for


def item(i: int, batch: int | None = None, timeout: int | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"id": i, "lease_token": f"00000000-0000-0000-0000-{i:012d}", "kind": "embed",
                           "payload": i, "attempt": 1}
    if batch is not None:
        out["batch"] = batch
    if timeout is not None:
        out["timeout"] = timeout
    return out


class Peer:
    """A scripted server: welcomes the agent in protocol 7, pushes ``items`` in one frame, keeps what
    comes back (each outcome by job id, the started ids, every hello)."""

    def __init__(self, items: list[dict[str, Any]]):
        self.items = items
        self.hellos: list[dict[str, Any]] = []
        self.outcomes: dict[int, dict[str, Any]] = {}
        self.started: list[int] = []
        self.ws: Any = None

    async def __call__(self, ws: Any) -> None:
        self.ws = ws
        self.hellos.append(json.loads(await ws.recv()))
        await ws.send(json.dumps({"type": "welcome", "agent_id": "scripted#1", "protocol": 7, "lease_seconds": 60,
                                  "heartbeat_seconds": 30, "max_payload": 1 << 20}))
        if len(self.hellos) == 1:
            await ws.send(json.dumps({"type": "jobs", "jobs": self.items}))
        async for raw in ws:
            frame = json.loads(raw)
            self.started += frame.get("started", frame.get("ids", []) if frame["type"] == "started" else [])
            for o in frame.get("results", []):
                self.outcomes[o["id"]] = o

    async def cancel(self, *ids: int) -> None:
        await self.ws.send(json.dumps({"type": "cancel", "ids": list(ids)}))

    def errors(self) -> dict[int, tuple[str, bool]]:
        """Each failed job's last error line and whether it may be retried."""
        return {i: (o["error"].strip().splitlines()[-1], o["retryable"])
                for i, o in self.outcomes.items() if o["type"] == "failed"}

    def results(self) -> dict[int, Any]:
        return {i: o["result"] for i, o in self.outcomes.items() if o["type"] == "done"}


async def run_against(peer: Peer, until: Any, **agent_kw: Any) -> Agent:
    """Run an ``Agent`` against ``peer`` until ``until()`` holds (a plain or async predicate)."""
    async with serve(peer, "127.0.0.1", 0) as server:
        port = next(iter(server.sockets)).getsockname()[1]
        kw = {"devices": (), "reconnect_min": 0.05, "max_batch": 8, **agent_kw}
        handler = kw.pop("handler", None)
        agent = Agent(f"ws://127.0.0.1:{port}/agent", TOKEN, ["embed"], kw.pop("capacity", 2), handler,
                      "scripted", **kw)
        async with anyio.create_task_group() as tg:
            tg.start_soon(agent.run)
            await wait_for(until)
            tg.cancel_scope.cancel()
    return agent


async def test_a_batch_of_3_runs_in_one_async_call_and_one_items_exception_fails_it_alone():
    calls: list[list[int]] = []
    singles: list[int] = []

    async def embed_many(jobs):
        calls.append([j.id for j in jobs])
        return [ValueError("bad text") if j.id == 2 else {"v": j.payload * 10} for j in jobs]

    async def embed(job):
        singles.append(job.id)
        return {"single": job.payload}

    peer = Peer([item(1, 1), item(2, 1), item(3, 1), item(4)])
    await run_against(peer, lambda: len(peer.outcomes) == 4, handler=embed, batch_handler=embed_many)
    assert peer.hellos[0]["batch"] == 8 and peer.hellos[0]["protocol"] == PROTOCOL_VERSION
    assert calls == [[1, 2, 3]] and singles == [4]  # one batch call; the single job to the plain handler
    assert peer.results() == {1: {"v": 10}, 3: {"v": 30}, 4: {"single": 4}}
    assert peer.errors() == {2: ("ValueError: bad text", True)}
    assert sorted(peer.started) == [1, 2, 3, 4]


async def test_a_sync_batch_handler_runs_in_a_worker_thread_and_takes_single_jobs_as_batches_of_one():
    calls: list[tuple[list[int], bool]] = []

    def embed_many(jobs):
        calls.append(([j.id for j in jobs], threading.current_thread() is threading.main_thread()))
        if jobs[0].id == 5:
            raise PermanentError("this model is gone")
        return [j.payload + 100 for j in jobs]

    peer = Peer([item(1, 1), item(2, 1), item(3, 1), item(4), item(5, 2), item(6, 2)])
    await run_against(peer, lambda: len(peer.outcomes) == 6, batch_handler=embed_many, capacity=1)
    assert sorted(calls) == [([1, 2, 3], False), ([4], False), ([5, 6], False)]
    assert peer.results() == {1: 101, 2: 102, 3: 103, 4: 104}
    assert peer.errors() == {5: ("gpuq.agent.handlers.PermanentError: this model is gone", False),
                             6: ("gpuq.agent.handlers.PermanentError: this model is gone", False)}


@pytest.mark.parametrize("sync", [False, True])
async def test_an_item_cancelled_mid_batch_ends_cancelled_and_the_others_go_on(sync):
    batch: list = []  # the jobs the handler got
    go_on = threading.Event()  # set once the handler can see item 2 cancelled

    def sync_many(jobs):
        batch.extend(jobs)
        go_on.wait(10)
        return [j.payload for j in jobs]

    async def async_many(jobs):
        batch.extend(jobs)
        await anyio.to_thread.run_sync(go_on.wait, 10)
        return [j.payload for j in jobs]

    peer = Peer([item(1, 1), item(2, 1), item(3, 1)])

    async def cancelled_mid_batch_and_all_reported() -> bool:
        if batch and not go_on.is_set():
            await peer.cancel(2)
            await wait_for(lambda: batch[1].cancelled)
            assert not batch[0].cancelled and not batch[2].cancelled
            go_on.set()
        return len(peer.outcomes) == 3

    await run_against(peer, cancelled_mid_batch_and_all_reported, batch_handler=sync_many if sync else async_many)
    assert peer.results() == {1: 1, 3: 3}  # item 2's result is discarded
    assert peer.errors() == {2: ("cancelled", False)}


async def test_a_batch_past_its_smallest_timeout_fails_every_item_timeout():
    async def stuck(jobs):
        await anyio.sleep_forever()

    peer = Peer([item(1, 1, timeout=60), item(2, 1, timeout=1), item(3, 1)])
    await run_against(peer, lambda: len(peer.outcomes) == 3, batch_handler=stuck)
    assert peer.errors() == {1: ("timeout", True), 2: ("timeout", True), 3: ("timeout", True)}


async def test_a_wrong_number_of_results_fails_every_item_permanently():
    async def short(jobs):
        return [1]

    peer = Peer([item(1, 1), item(2, 1)])
    await run_against(peer, lambda: len(peer.outcomes) == 2, batch_handler=short)
    assert {i: e[1] for i, e in peer.errors().items()} == {1: False, 2: False}
    assert "returned a list of 1 for 2 jobs" in peer.outcomes[1]["error"]


async def test_a_batch_breaking_the_rules_is_a_protocol_error_the_agent_survives_by_reconnecting():
    async def embed_many(jobs):
        return [j.payload for j in jobs]

    peer = Peer([item(1, 1), item(2, 1), item(3, 1)])  # three items to an agent taking two
    agent = await run_against(peer, lambda: len(peer.hellos) >= 2, batch_handler=embed_many, max_batch=2)
    assert peer.outcomes == {} and agent.protocol.running == {}


def test_handlers_must_be_both_async_or_both_sync_and_one_is_needed():
    async def a(job):
        return None

    def s(jobs):
        return []

    with pytest.raises(ValueError, match="both be async, or both sync"):
        Agent("ws://127.0.0.1:1/agent", TOKEN, ["embed"], 1, a, batch_handler=s, devices=())
    with pytest.raises(ValueError, match="needs a handler"):
        Agent("ws://127.0.0.1:1/agent", TOKEN, ["embed"], 1, None, devices=())
    assert Agent("ws://127.0.0.1:1/agent", TOKEN, ["embed"], 1, a, devices=()).protocol.hello.batch == 0
