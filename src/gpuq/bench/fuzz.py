"""Protocol fuzzing against a live server (``gpuq bench fuzz``; the suite runs a shorter profile).

Hypothesis generates frames (random text and bytes, random JSON, and valid
messages mutated: keys dropped or added, values swapped for odd types, huge
numbers, unicode, stale lease tokens, oversized padding). Each frame goes to
the server on an authenticated connection, followed by a sentinel whose reply
is known. The frame must be answered (``error`` or ``ack``) or the connection
closed with a documented close code, and the sentinel's reply must arrive:
the server never hangs and never crashes. Afterwards the database must show
that no job changed except through its lease holder.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from typing import Any

import anyio

from gpuq import db, protocol, queue
from gpuq.bench import common
from gpuq.harness import TOKEN, ThreadedServer

MAX_PAYLOAD = 4096
SENTINEL = json.dumps({"type": "heartbeat", "ids": [protocol.MAX_JOB_ID]})
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def strategies(stale_tokens: list[str], stale_ids: list[int]) -> Any:
    """The frames to send: a hypothesis strategy of ``str | bytes``."""
    from hypothesis import strategies as st

    json_leaf = (st.none() | st.booleans() | st.integers(-(2**80), 2**80) | st.floats(allow_nan=False)
                 | st.text(max_size=30))
    json_value = st.recursive(json_leaf, lambda inner: st.lists(inner, max_size=4)
                              | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)
    token = st.sampled_from(stale_tokens) | st.uuids().map(str) | st.text(max_size=40)
    job_id = st.sampled_from(stale_ids) | st.integers(-(2**70), 2**70)
    outcome = st.one_of(
        st.builds(lambda i, t, r: {"type": "done", "id": i, "lease_token": t, "result": r}, job_id, token, json_value),
        st.builds(lambda i, t, e, r: {"type": "failed", "id": i, "lease_token": t, "error": e, "retryable": r},
                  job_id, token, st.text(max_size=50), st.booleans()),
    )
    valid = st.one_of(
        outcome,
        st.builds(lambda items: {"type": "results", "results": items},
                  st.lists(outcome | json_value, max_size=6)),
        st.builds(lambda ids: {"type": "heartbeat", "ids": ids}, st.lists(job_id, max_size=5)),
        st.just({"type": "drain"}),
        st.builds(lambda a, k, c, p: {"type": "hello", "agent": a, "kinds": k, "capacity": c, "protocol": p},
                  st.text(max_size=20), st.lists(st.text(max_size=10), max_size=3), st.integers(-5, 5000),
                  st.integers(0, 3)),
    )

    def mutate(msg: dict[str, Any], how: int, key: str, value: Any) -> Any:
        msg = dict(msg)
        keys = sorted(msg)
        if how == 0 and len(keys) > 1:  # drop a field
            msg.pop(keys[len(key) % len(keys)])
        elif how == 1:  # add a field
            msg[key or "extra"] = value
        elif how == 2:  # replace a field's value
            msg[keys[len(key) % len(keys)]] = value
        elif how == 3:  # change the type name
            msg["type"] = key
        return msg

    mutated = st.builds(mutate, valid, st.integers(0, 4), st.text(max_size=8), json_value)
    as_text = (valid | mutated | json_value).map(lambda v: json.dumps(v, allow_nan=True))
    oversized = st.integers(MAX_PAYLOAD + 1, MAX_PAYLOAD * 3).map(
        lambda n: json.dumps({"type": "heartbeat", "ids": [], "pad": "x" * n}))
    return st.one_of(as_text, as_text, as_text, st.text(max_size=200), st.binary(max_size=100), oversized,
                     st.sampled_from(["", "{", "null", "[]", '{"type": null}', "NaN", '{"type": "done"}' * 3]))


class Client:
    """A sync websocket agent that reconnects whenever the server closes on it."""

    def __init__(self, url: str):
        self.url = url
        self.ws: Any = None
        self.closes: dict[int, int] = {}

    def _open(self) -> Any:
        from websockets.sync.client import connect

        ws = connect(self.url, additional_headers=AUTH, open_timeout=10, legacy=True)
        ws.send(json.dumps({"type": "hello", "agent": "fuzzer", "kinds": ["fuzz-nothing"], "capacity": 1,
                            "protocol": 1}))
        assert json.loads(ws.recv(timeout=10))["type"] == "welcome"
        return ws

    def check(self, frame: str | bytes) -> None:
        """Send one frame then the sentinel; fail unless both are handled as documented."""
        from websockets.exceptions import ConnectionClosed

        if self.ws is None:
            self.ws = self._open()
        try:
            self.ws.send(frame)
            self.ws.send(SENTINEL)
            while True:
                reply = json.loads(self.ws.recv(timeout=10))
                if reply["type"] not in ("error", "ack"):
                    raise AssertionError(f"unexpected reply {reply!r} to {frame!r:.200}")
                if reply["type"] == "error" and reply["code"] not in KNOWN_ERRORS:
                    raise AssertionError(f"undocumented error code {reply['code']!r}")
                if reply["type"] == "error" and reply["code"] == protocol.ErrorCode.NOT_HELD and str(protocol.MAX_JOB_ID) in reply["message"]:
                    return  # the sentinel's answer: everything before it was handled
        except ConnectionClosed as exc:
            code = exc.rcvd.code if exc.rcvd else None
            if code not in _CLOSE_CODES:
                raise AssertionError(f"closed with undocumented code {code} after {frame!r:.200}") from None
            self.closes[code] = self.closes.get(code, 0) + 1
            self.ws = None
        except TimeoutError:
            raise AssertionError(f"no answer within 10 s to {frame!r:.200}") from None

    def close(self) -> None:
        if self.ws is not None:
            self.ws.close()


KNOWN_ERRORS = {code.value for code in protocol.ErrorCode}
_CLOSE_CODES = {code.value for code in protocol.CloseCode}


async def prepare(dsn: str) -> dict[str, Any]:
    """Jobs the fuzzer must not be able to touch: pending, leased to a victim, and finished ones
    whose (now stale) tokens the fuzzer replays."""
    conn = await db.connect(dsn)
    try:
        await conn.execute(common.queries["fuzz_victims"])
        finished = (await queue.lease(conn, ["victim"], 10, "gone#00000000", 300)).jobs
        await queue.complete_many(conn, [(j.id, j.lease_token, {"by": "owner"}) for j in finished])
        held = (await queue.lease(conn, ["victim"], 10, "victim#00000000", 300)).jobs
        snapshot = [tuple(r) for r in await conn.fetch(common.queries["fuzz_snapshot"])]
    finally:
        await conn.close()
    return {"stale_tokens": [j.lease_token for j in finished] + [str(uuid.uuid4())],
            "stale_ids": [j.id for j in finished + held] + [1, 2**62], "snapshot": snapshot}


async def changed(dsn: str, before: list[tuple[Any, ...]]) -> list[Any]:
    """Rows that differ from the snapshot (must be none)."""
    conn = await db.connect(dsn)
    try:
        after = [tuple(r) for r in await conn.fetch(common.queries["fuzz_snapshot"])]
    finally:
        await conn.close()
    return [(a, b) for a, b in zip(before, after, strict=False) if a != b] + (
        [("row count", len(before), len(after))] if len(before) != len(after) else [])


def run_fuzz(dsn: str, examples: int, seed: int | None = None) -> dict[str, Any]:
    """Fuzz a live server with ``examples`` frames; raise on any violation; return figures."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    state = anyio.run(prepare, dsn)
    figures: dict[str, Any] = {"examples": 0}
    with ThreadedServer(dsn, max_payload=MAX_PAYLOAD, lease_seconds=300, heartbeat_seconds=10,
                        drain_seconds=2) as server:
        client = Client(server.url)

        @settings(max_examples=examples, deadline=None, database=None, derandomize=seed is None,
                  suppress_health_check=list(HealthCheck))
        @given(strategies(state["stale_tokens"], state["stale_ids"]))
        def fuzz(frame: str | bytes) -> None:
            figures["examples"] += 1
            client.check(frame)
            assert server.alive(), "the server died"

        if seed is not None:
            fuzz = hseed(seed)(fuzz)
        fuzz()
        client.close()
        figures["closes"] = {str(k): v for k, v in sorted(client.closes.items())}
        figures["healthy_agent_served"] = _healthy_agent_is_served(server, dsn)
    if bad := anyio.run(changed, dsn, state["snapshot"]):
        raise AssertionError(f"jobs changed by the fuzzer: {bad[:5]}")
    figures["jobs_changed"] = 0
    return figures


def _healthy_agent_is_served(server: ThreadedServer, dsn: str) -> bool:
    from websockets.sync.client import connect

    async def sql(name: str, *args: Any) -> Any:
        conn = await db.connect(dsn)
        try:
            return await conn.fetchval(common.queries[name], *args)
        finally:
            await conn.close()

    with connect(server.url, additional_headers=AUTH) as ws:
        ws.send(json.dumps({"type": "hello", "agent": "healthy", "kinds": ["healthy"], "capacity": 1,
                            "protocol": 1}))
        ws.recv(timeout=10)
        jid = anyio.run(sql, "fuzz_insert_one")
        job = json.loads(ws.recv(timeout=10))["jobs"][0]
        ws.send(json.dumps({"type": "done", "id": job["id"], "lease_token": job["lease_token"], "result": 1}))
        ack = json.loads(ws.recv(timeout=10))
    anyio.run(sql, "fuzz_delete", jid)  # keep the snapshot comparison exact
    return bool(job["id"] == jid and ack["accepted"] == [jid])


# -- gpuq bench fuzz --------------------------------------------------------


def register(sub: Any) -> None:
    def args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--examples", type=int, default=20_000, help="frames to send (default 20000)")
        p.add_argument("--seed", type=int, help="hypothesis seed (default: derandomized)")

    async def body(t: common.Target, a: argparse.Namespace) -> dict[str, Any]:
        await common.reset_gpuq_schema(t.dsn)
        t0 = time.monotonic()
        # run_fuzz drives sync websocket clients and its own server thread.
        figures = await anyio.to_thread.run_sync(run_fuzz, t.dsn, a.examples, a.seed)
        return {"bench": "fuzz", **figures, "seconds": round(time.monotonic() - t0, 1)}

    def report(figures: dict[str, Any]) -> None:
        print(f"fuzzed {figures['examples']} frames in {figures['seconds']} s: server stayed up, "
              f"closes by code {figures['closes']}, jobs changed: 0")

    common.declare(sub, "fuzz", "protocol fuzzing against a live server (hypothesis)", __doc__, args, body, report)


if __name__ == "__main__":
    raise SystemExit(common.standalone("fuzz"))
