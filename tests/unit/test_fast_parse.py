"""The msgspec fast path (protocol/fast.py): the same message as the strict path, or the strict path.

Frames are written here as text, so they can hold what ``json.dumps`` never
writes: duplicate keys, NaN, 1e400, lone surrogates, deep nesting. Each is
parsed twice, by ``parse_client`` / ``parse_server`` (fast path, then the
strict one) and by the strict path alone; the answers must be the same: an
equal message of the same repr (types too: 1 is not 1.0), or the same error.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuq.protocol import MAX_ERROR_TEXT, MAX_RESULTS, ProtocolError, fast, frames, parse
from gpuq.protocol import messages as m

MAX_SIZE = 1 << 20


class Raw(str):
    """JSON text put into a frame as it is."""


class Obj(list):
    """A JSON object as (key, value) pairs: a key may repeat."""


def render(value: Any, ascii_only: bool = True) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, Obj):
        return "{" + ",".join(f"{json.dumps(k)}:{render(v, ascii_only)}" for k, v in value) + "}"
    if isinstance(value, list):
        return "[" + ",".join(render(v, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


def answer(parse_fn: Any, *args: Any) -> tuple[Any, ...]:
    """What parsing gives: the message (and its repr), or the error as the connection sees it."""
    try:
        msg = parse_fn(*args)
    except ProtocolError as exc:
        return "error", exc.code, str(exc), exc.fatal, exc.close
    except Exception as exc:  # noqa: BLE001 - an error of the strict path must stay the same too
        return "raised", type(exc).__name__, str(exc)
    return "message", msg, repr(msg)


# -- values ------------------------------------------------------------------

WEIRD = [Raw(t) for t in (
    "NaN", "Infinity", "-Infinity", "1e400", "-1e400", "1.0", "1e3", "0.0", "-0", "-0.0", "true", "false", "null",
    "0", "-1", str(2**63 - 1), str(2**63), str(2**64), str(2**64 + 1), str(10**400), "123456789012345678901.5",
    '"\\ud800"', '"a\\udc00"', '"\\u0000"', '"x\\u0000y"', '"\\\\u0000"', '"\\/"', '"\u00e9\U0001F600"', "[]", "{}",
    '"00000000-0000-0000-0000-000000000007"', '"00000000-0000-0000-0000-00000000000A"',
    "[" * 150 + "]" * 150, "[" * 199 + "]" * 199, "[" * 201 + "]" * 201, "[{" * 300 + "}]" * 300,
    "[" * 3000 + "]" * 3000,
)]
# Numbers as text: long mantissas, exponents, under- and overflow (1e400: json's inf).
numbers = st.from_regex(r"\A-?(0|[1-9][0-9]{0,25})(\.[0-9]{1,25})?([eE][+-]?[0-9]{1,3})?\Z").map(Raw)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | numbers
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)
ids = st.integers(1, 2**63 - 1) | st.sampled_from([1, 2**63 - 1])
tokens = st.uuids().flatmap(lambda u: st.sampled_from([str(u)] * 8 + [str(u).upper(), u.hex]))  # fields.token takes all
values = json_values | st.sampled_from(WEIRD)


# -- frames ------------------------------------------------------------------

def outcome(kind: str, id_: int, token: str, result: Any, error: str, retryable: bool) -> Obj:
    fields = Obj([("type", kind), ("id", id_), ("lease_token", token)])
    if kind == "done":
        fields.append(("result", result))
    elif kind == "failed":
        fields += [("error", error), ("retryable", retryable)]
    return fields


outcomes = st.builds(outcome, st.sampled_from(["done", "failed", "preempted"]), ids, tokens, json_values,
                     st.text(max_size=20) | st.just("e" * (MAX_ERROR_TEXT + 5)), st.booleans())


@st.composite
def mutated(draw: Any, obj: Obj) -> Obj:
    """``obj`` with a few fields dropped, renamed, retyped, repeated or added (maybe none)."""
    obj = Obj(obj)
    for _ in range(draw(st.integers(0, 2))):
        what = draw(st.sampled_from(["drop", "rename", "retype", "repeat", "add"]))
        at = draw(st.integers(0, max(0, len(obj) - 1)))
        if what == "add" or not obj:
            obj.insert(at, (draw(st.sampled_from(["extra", "type", "id", "result", "started"])), draw(values)))
        elif what == "drop":
            del obj[at]
        elif what == "rename":
            obj[at] = (obj[at][0] + "_", obj[at][1])
        elif what == "retype":
            obj[at] = (obj[at][0], draw(values))
        else:
            obj.insert(draw(st.integers(0, len(obj))), (obj[at][0], draw(st.just(obj[at][1]) | values)))
    return obj


@st.composite
def client_frames(draw: Any) -> str:
    items = draw(st.lists(outcomes, min_size=1, max_size=6))
    if draw(st.integers(0, 2)) == 0:
        items = [draw(mutated(i)) for i in items]
    if draw(st.integers(0, 9)) == 0:
        items.insert(draw(st.integers(0, len(items))), draw(values))  # not an object
    if draw(st.integers(0, 3)) == 0:
        return render(items[0], draw(st.booleans()))  # a lone outcome
    frame = Obj([("type", "results"), ("results", items)])
    if draw(st.booleans()):
        frame.insert(draw(st.integers(0, 2)), ("started", draw(st.lists(ids, max_size=4))))
    if draw(st.integers(0, 2)) == 0:
        frame = draw(mutated(frame))
    return render(frame, draw(st.booleans()))


def job(id_: int, token: str, kind: Any, payload: Any, attempt: Any, optional: list[tuple[str, Any]]) -> Obj:
    return Obj([("id", id_), ("lease_token", token), ("kind", kind), ("payload", payload), ("attempt", attempt),
                *optional])


OPTIONAL = {
    "timeout": st.none() | st.integers(1, 10**6), "devices": st.none() | st.lists(st.integers(0, 255), max_size=3),
    "queued_ms": st.none() | st.integers(0, 10**9), "batch": st.none() | ids,
    "traceparent": st.text(min_size=1, max_size=60), "tracestate": st.none() | st.text(min_size=1, max_size=20),
    "resume_from": json_values, "grace_seconds": st.none() | st.floats(0.001, 86400) | st.integers(1, 86400),
}
jobs = st.builds(job, ids, tokens, st.text(max_size=10), json_values, st.integers(1, 100),
                 st.lists(st.sampled_from(sorted(OPTIONAL)), unique=True).flatmap(
                     lambda names: st.tuples(*(st.tuples(st.just(n), OPTIONAL[n]) for n in names)).map(list)))


@st.composite
def server_frames(draw: Any) -> str:
    items = draw(st.lists(jobs, max_size=5))
    if draw(st.integers(0, 2)) == 0:
        items = [draw(mutated(j)) for j in items]
    frame = Obj([("type", draw(st.sampled_from(["jobs", "jobs", "jobs", "ack"]))), ("jobs", items)])
    if draw(st.integers(0, 2)) == 0:
        frame = draw(mutated(frame))
    return render(frame, draw(st.booleans()))


# -- the property --------------------------------------------------------------

@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(client_frames(), st.sampled_from([MAX_SIZE, MAX_SIZE, 200]))
def test_an_agents_frame_parses_as_the_strict_path_alone_parses_it(frame, max_size):
    assert answer(parse.parse_client, frame, max_size) == answer(parse.parse_client_slow, frame, max_size)


@settings(max_examples=150, suppress_health_check=[HealthCheck.too_slow])
@given(server_frames())
def test_a_servers_frame_parses_as_the_strict_path_alone_parses_it(frame):
    assert answer(parse.parse_server, frame) == answer(parse.parse_server_slow, frame)


@pytest.mark.parametrize("frame", [
    '{"type":"results","results":[' + ",".join([frames.encode_done(1, str(uuid.UUID(int=1)), None)] * (MAX_RESULTS + 1))
    + "]}",
    '{"type":"results","results":[]}',
    '{"type":"results","started":[' + ",".join(["1"] * 4097) + '],"results":[{"type":"preempted","id":1,'
    '"lease_token":"00000000-0000-0000-0000-000000000001"}]}',
    b'{"type":"drain"}',
    '{"type":"done","id":1,"lease_token":"00000000-0000-0000-0000-000000000001","result":"\\u0000"}',
    '{"type":"done","id":1,"lease_token":"00000000-0000-0000-0000-000000000001","result":"\ud800"}',
    '{"type":"failed","id":1,"lease_token":"00000000-0000-0000-0000-000000000001","error":"a\\u0000b",'
    '"retryable":true}',
    '{"\\u0074ype":"d\\u006fne","i\\u0064":1,"lease_token":"00000000-0000-0000-0000-00000000000\\u0031","result":1}',
])
def test_the_limits_and_the_rules_the_fast_path_leaves_to_the_strict_one(frame):
    assert answer(parse.parse_client, frame, MAX_SIZE) == answer(parse.parse_client_slow, frame, MAX_SIZE)
    assert answer(parse.parse_client, frame, 50) == answer(parse.parse_client_slow, frame, 50)


@pytest.mark.parametrize("depth", [fast.MAX_NESTING - 1, fast.MAX_NESTING, fast.MAX_NESTING + 1, 990, 1000])
def test_deep_results_and_payloads_parse_as_the_strict_path_parses_them(depth):
    """Where ``json`` stops depends on the stack, not the frame: the fast path stops earlier."""
    nested = "[" * depth + "]" * depth
    done = frames.pack_results([frames.encode_done(1, str(uuid.UUID(int=1)), None).replace("null", nested)], MAX_SIZE)[0]
    assert answer(parse.parse_client, done, MAX_SIZE) == answer(parse.parse_client_slow, done, MAX_SIZE)
    pushed = frames.jobs_frame([frames.job_message(1, str(uuid.UUID(int=1)), "k", nested, 1)])
    assert answer(parse.parse_server, pushed) == answer(parse.parse_server_slow, pushed)
    assert (fast.server_jobs(pushed) is None) is (depth > fast.MAX_NESTING)


# -- the fast path is taken ------------------------------------------------------

def ordinary_frames() -> tuple[list[str], list[str]]:
    """What an agent and a server send: outcomes of every kind, and jobs with every optional field."""
    token = str(uuid.uuid4())
    items = [frames.encode_done(i, token, {"loss": 0.5, "steps": [i, None]}) for i in range(1, 40)]
    items += [frames.encode(m.Failed(41, token, "boom", True)), frames.encode(m.Preempted(42, token))]
    client = [*frames.pack_results(items, MAX_SIZE, started=(1, 2)), *frames.pack_results(items, MAX_SIZE),
              items[0], items[-2], items[-1]]
    pushed = [frames.job_message(i, token, "train", '{"lr": 0.1}', 2, 60, (0, 1), 12, 3, ("00-ab-cd-01", "k=v"),
                                 '{"step": 7}', 30.0) for i in range(1, 20)]
    pushed.append(frames.job_message(20, token, "noop", "null", 1))
    return client, [frames.jobs_frame(pushed), frames.jobs_frame([])]


def test_ordinary_frames_never_reach_the_strict_path(monkeypatch):
    client, server = ordinary_frames()
    expected = [parse.parse_client_slow(f, MAX_SIZE) for f in client], [parse.parse_server_slow(f) for f in server]

    def strict(*args: Any) -> Any:
        raise AssertionError("the strict path parsed an ordinary frame")

    monkeypatch.setattr(parse, "parse_client_slow", strict)
    monkeypatch.setattr(parse, "parse_server_slow", strict)
    assert [parse.parse_client(f, MAX_SIZE) for f in client] == expected[0]
    assert [parse.parse_server(f) for f in server] == expected[1]
    assert all(type(o) is m.Done for o in expected[0][0].outcomes[:39])  # the types parse builds


def test_other_frames_and_errors_go_the_strict_way(monkeypatch):
    seen: list[Any] = []
    monkeypatch.setattr(parse, "parse_client_slow", lambda *args: seen.append(args[0]))
    monkeypatch.setattr(parse, "parse_server_slow", lambda *args: seen.append(args[0]))
    token = str(uuid.uuid4())
    heartbeat, upper = '{"type":"heartbeat","ids":[]}', frames.encode_done(1, token.upper(), None)
    ack, big = '{"type":"ack","accepted":[],"rejected":[]}', frames.encode_done(1, token, "x" * 100)
    for frame in (heartbeat, upper, big):
        parse.parse_client(frame, 100)
    parse.parse_server(ack)
    assert seen == [heartbeat, upper, big, ack]
