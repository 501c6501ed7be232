"""The protocol module alone (no I/O): packing outcomes into results frames, and the U+0000 rule."""

import json
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuq import protocol
from gpuq.kinds import KIND_PATTERN
from gpuq.protocol import Done, Failed, Results, encode

TOKEN = str(uuid.UUID(int=7))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)
outcomes = st.one_of(
    st.builds(Done, st.integers(1, 2**63 - 1), st.just(TOKEN), json_values),
    st.builds(Failed, st.integers(1, 2**63 - 1), st.just(TOKEN), st.text(max_size=40), st.booleans()),
)


@given(st.lists(outcomes, min_size=1, max_size=60), st.integers(300, 3000))
def test_packed_frames_fit_and_parse_back_to_the_same_outcomes_in_order(items, max_size):
    items = [o for o in items if not (isinstance(o, Done) and protocol.contains_nul(o.result))]
    items = [o for o in items if len(encode(o)) <= max_size - protocol.RESULTS_OVERHEAD]
    encoded = [encode(o) for o in items]
    frames = protocol.pack_results(encoded, max_size)
    assert all(len(f) <= max_size for f in frames)
    parsed = [o for f in frames for o in protocol.parse_client(f, max_size).outcomes]
    assert parsed == [protocol.parse_client(e, max_size) for e in encoded]
    assert [o.id for o in parsed] == [o.id for o in items]


def test_a_frame_holds_at_most_max_results_outcomes():
    item = encode(Done(1, TOKEN, None))
    frames = protocol.pack_results([item] * (protocol.MAX_RESULTS + 1), 1 << 30)
    assert [f.count('"done"') for f in frames] == [protocol.MAX_RESULTS, 1]
    assert protocol.pack_results([], 1000) == []


def test_encode_results_is_one_frame():
    msg = Results((Done(1, TOKEN, {"a": 1}), Failed(2, TOKEN, "no", False)))
    assert protocol.parse_client(encode(msg), 1 << 20) == msg


@pytest.mark.parametrize("value, has_nul", [
    ("plain", False), ("\\u0000 as six characters", False), ({"k": ["a", "b\x00"]}, True),
    ({"k\x00": 1}, True), ([1, 2.5, None, True], False),
])
def test_contains_nul_finds_real_nul_characters_only(value, has_nul):
    assert protocol.contains_nul(value) is has_nul
    frame = encode(Done(1, TOKEN, value))
    if has_nul:
        with pytest.raises(protocol.ProtocolError, match="U\\+0000"):
            protocol.parse_client(frame, 1 << 20)
    else:  # the text "\u0000" (backslash, u, zeros) is a fine result
        assert protocol.parse_client(frame, 1 << 20).result == json.loads(frame)["result"]


def test_tokens_are_normalized_so_credit_bookkeeping_matches():
    upper = TOKEN.upper()
    msg = protocol.parse_client(json.dumps({"type": "done", "id": 1, "lease_token": upper, "result": 1}), 1000)
    assert msg.lease_token == TOKEN


@given(st.integers(1, 2**63 - 1), st.uuids().map(str), json_values)
def test_encode_done_is_a_done_message_the_server_parses_back(job_id, token, result):
    frame = protocol.encode_done(job_id, token, result)
    assert frame == encode(Done(job_id, token, result))
    if protocol.contains_nul(result):  # valid JSON, refused by the server (jsonb cannot store it)
        with pytest.raises(protocol.ProtocolError, match="U\\+0000"):
            protocol.parse_client(frame, 1 << 20)
    else:
        assert protocol.parse_client(frame, 1 << 20) == Done(job_id, token, result)


@given(st.integers(1, 2**63 - 1), st.uuids().map(str), st.from_regex(KIND_PATTERN, fullmatch=True),
       json_values, st.integers(1, 1000), st.booleans())
def test_job_message_splices_the_payload_text_into_a_valid_job(job_id, token, kind, payload, attempt, spaced):
    # PostgreSQL's jsonb text has spaces after ':' and ','; any valid JSON text must do.
    payload_json = json.dumps(payload, ensure_ascii=False, separators=(", ", ": ") if spaced else (",", ":"))
    frame = protocol.jobs_frame([protocol.job_message(job_id, token, kind, payload_json, attempt)] * 2)
    parsed = protocol.parse_server(frame)
    assert parsed.jobs == (protocol.JobMessage(job_id, token, kind, payload, attempt),) * 2


@pytest.mark.parametrize("frame", [
    '{"type":"welcome","agent_id":"a#1","lease_seconds":30,"heartbeat_seconds":10,"max_payload":1e400,"protocol":9}',
    '{"type":"welcome","agent_id":"a#1","lease_seconds":1' + "0" * 400 + ',"heartbeat_seconds":10,"max_payload":1,'
    '"protocol":9}',
    protocol.jobs_frame([protocol.job_message(1, TOKEN, "k", "null", 1)]).replace('"attempt":1', '"attempt":1,"timeout":1' + "0" * 400),
])
def test_a_server_frame_with_a_number_out_of_range_is_malformed_not_a_crash(frame):
    """``int(inf)`` and ``float(10**400)`` raise OverflowError: the agent's run() would end on it."""
    with pytest.raises(protocol.ProtocolError, match="malformed"):
        protocol.parse_server(frame)
