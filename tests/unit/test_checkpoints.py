"""Checkpoints (protocol 9), the protocol's side: the agent's queue (interval, coalescing, the flush
before an outcome, receipts), the messages, and the server's rules. No socket, no database."""

import asyncio
import json
import threading

import pytest

from gpuq.protocol import (
    MAX_CHECKPOINT_DATA,
    Checkpoint,
    Checkpointed,
    CheckpointItem,
    ErrorCode,
    Hello,
    JobMessage,
    Welcome,
    encode,
    job_message,
    jobs_frame,
    parse_client,
    parse_server,
)
from gpuq.protocol.agent_side import AgentProtocol
from gpuq.protocol.receipts import Receipt
from gpuq.protocol.server_side import CheckpointsReceived, FrameRefused, ServerProtocol
from gpuq.testing import LocalAgent, run_job

TOKEN = "00000000-0000-0000-0000-000000000000"
OTHER = "11111111-1111-1111-1111-111111111111"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def agent(interval: float = 10.0, version: int = 9) -> tuple[AgentProtocol, Clock]:
    clock = Clock()
    p = AgentProtocol(Hello("a", ("train",), 4), clock)
    p.checkpoints.interval = interval
    p.connection_made()
    p.frames_to_send()
    p.receive(encode(Welcome("a#1", 30, 5, 1 << 20, version)))
    p.receive(jobs_frame([job_message(1, TOKEN, "train", "{}", 1), job_message(2, TOKEN, "train", "{}", 1)]))
    return p, clock


def checkpoint(p: AgentProtocol, job_id: int, data: object, token: str = TOKEN) -> tuple[Receipt, bool]:
    return p.checkpoints.add(job_id, token, json.dumps(data))


def sent(p: AgentProtocol) -> list[dict]:
    """What the agent sends now: each frame parsed as the server parses it."""
    return [{"msg": parse_client(f, 1 << 20), "type": json.loads(f)["type"]} for f in p.frames_to_send()]


def items(p: AgentProtocol) -> list[tuple[int, int, object]]:
    """The checkpoints the agent sends now, as (job id, seq, data)."""
    return [(c.id, c.seq, c.data) for f in sent(p) if isinstance(f["msg"], Checkpoint) for c in f["msg"].items]


def answer(p: AgentProtocol, stored=(), refused=()) -> None:
    p.receive(encode(Checkpointed(tuple(stored), tuple(refused))))


# -- the agent's queue --------------------------------------------------------


def test_a_jobs_first_checkpoint_goes_at_once_and_later_ones_coalesce_until_the_interval_lapses():
    p, clock = agent(interval=10)
    first, ask = checkpoint(p, 1, {"step": 1})
    assert ask and p.checkpoints.due() is None
    [(job_id, seq, data)] = items(p)
    assert (job_id, data) == (1, {"step": 1})
    second, ask = checkpoint(p, 1, {"step": 2})
    third, again = checkpoint(p, 1, {"step": 3})
    assert ask and not again  # one look is enough for both
    clock.now += 4
    assert p.checkpoints.due() == pytest.approx(6)  # not yet: the interval runs from the last one sent
    assert items(p) == []
    clock.now += 6
    assert p.checkpoints.due() is None
    [(_, later, data)] = items(p)
    assert data == {"step": 3}  # the latest; {"step": 2} was replaced, never sent
    answer(p, stored=[seq])
    assert first.stored is True and not second.done()
    answer(p, stored=[later])
    assert second.stored is True and third.stored is True  # the one that replaced it was stored


def test_each_job_has_its_own_interval():
    p, clock = agent(interval=10)
    checkpoint(p, 1, "a")
    p.checkpoints.due()
    checkpoint(p, 2, "b")  # job 2's first: at once, though job 1 sent one just now
    checkpoint(p, 1, "c")
    assert p.checkpoints.due() == pytest.approx(10)
    assert [(i, d) for i, _, d in items(p)] == [(1, "a"), (2, "b")]


def test_a_waiting_checkpoint_goes_before_the_jobs_outcome_whatever_the_interval():
    p, _ = agent(interval=3600)
    checkpoint(p, 1, {"step": 1})
    p.checkpoints.due()
    items(p)
    waiting, _ = checkpoint(p, 1, {"step": 2})
    p.job_done(JobMessage(1, TOKEN, "train", {}, 1), "ok")
    frames = sent(p)
    assert [f["type"] for f in frames] == ["checkpoint", "results"]  # in this order, so stored first
    [item] = frames[0]["msg"].items
    assert (item.id, item.data) == (1, {"step": 2})
    answer(p, refused=[item.seq])
    assert waiting.stored is False


def test_a_draining_agent_sends_each_checkpoint_at_once():
    p, _ = agent(interval=3600)
    checkpoint(p, 1, 1)
    p.checkpoints.due()
    checkpoint(p, 1, 2)
    assert p.checkpoints.due() == pytest.approx(3600)
    p.drain()  # leaving (stop, SIGTERM): the interval would hold this one past the end
    assert p.checkpoints.due() is None
    assert [d for _, _, d in items(p)] == [1, 2]


def test_a_refused_checkpoint_resolves_its_receipts_false():
    p, _ = agent(interval=0)
    receipt, _ = checkpoint(p, 1, "late")
    p.checkpoints.due()
    [(_, seq, _)] = items(p)
    answer(p, refused=[seq])
    assert receipt.stored is False and receipt.wait(0) is False


def test_a_lost_connection_resolves_every_receipt_false_and_refuses_its_jobs_later_checkpoints():
    p, _ = agent(interval=3600)
    sent_one, _ = checkpoint(p, 1, 1)
    p.checkpoints.due()
    items(p)
    waiting, _ = checkpoint(p, 1, 2)
    p.connection_lost()
    assert sent_one.stored is False and waiting.stored is False
    late, ask = checkpoint(p, 1, 3)  # a sync handler still running: the server gave its job back
    assert late.stored is False and not ask


def test_a_connection_of_an_earlier_version_takes_no_checkpoint():
    p, _ = agent(version=8)
    receipt, ask = checkpoint(p, 1, {"step": 1})
    assert receipt.stored is False and not ask
    assert items(p) == []


def test_a_checkpoint_too_large_for_the_servers_frames_is_refused_by_the_agent():
    p = AgentProtocol(Hello("a", ("train",), 1))
    p.checkpoints.interval = 0
    p.connection_made()
    p.frames_to_send()
    p.receive(encode(Welcome("a#1", 30, 5, 1024)))  # max_payload 1024
    p.receive(jobs_frame([job_message(1, TOKEN, "train", "{}", 1)]))
    receipt, _ = checkpoint(p, 1, "x" * 2000)
    p.checkpoints.due()
    assert items(p) == [] and receipt.stored is False


# -- receipts -----------------------------------------------------------------


async def test_a_receipt_is_awaited_on_a_loop_and_waited_on_in_a_thread_resolved_from_another():
    receipt = Receipt()
    in_thread: list[object] = []
    waiter = threading.Thread(target=lambda: in_thread.append(receipt.wait(10)))
    waiter.start()
    threading.Thread(target=receipt.resolve, args=(True,)).start()
    assert await asyncio.wait_for(asyncio.ensure_future(_await(receipt)), 10) is True
    waiter.join(10)
    assert in_thread == [True]
    receipt.resolve(False)  # the first answer counts
    assert receipt.stored is True and await receipt is True


async def test_waiting_on_a_receipt_on_the_event_loop_is_refused_not_a_deadlock():
    receipt = Receipt()
    with pytest.raises(RuntimeError, match="await the receipt"):
        receipt.wait(1)
    receipt.resolve(True)
    assert receipt.wait() is True  # answered: nothing to wait for


async def _await(receipt: Receipt) -> bool:
    return await receipt


# -- messages -------------------------------------------------------------------


def test_checkpoint_data_is_checked_where_the_handler_calls():
    job = JobMessage(1, TOKEN, "train", {}, 1)
    for bad in (None, {"x": float("nan")}, object(), "x" * MAX_CHECKPOINT_DATA, {"k": "\x00"}):
        with pytest.raises(ValueError):
            job.checkpoint(bad)
    assert job.checkpoint({"ok": 1}).stored is False  # no agent attached: nowhere to store it


def test_the_messages_round_trip():
    msg = Checkpoint((CheckpointItem(7, TOKEN, 3, {"step": 5, "uri": "s3://b/w"}),))
    assert parse_client(encode(msg), 1 << 20) == msg
    answered = Checkpointed((3, 4), (5,))
    assert parse_server(encode(answered)) == answered
    [job] = parse_server(jobs_frame([job_message(7, TOKEN, "train", "{}", 2, resume_json='{"step":5}')])).jobs
    assert job.resume_from == {"step": 5}
    [plain] = parse_server(jobs_frame([job_message(8, TOKEN, "train", "{}", 1)])).jobs
    assert plain.resume_from is None


@pytest.mark.parametrize("item", [
    {"id": 1, "lease_token": TOKEN, "seq": 1, "data": None},
    {"id": 1, "lease_token": TOKEN, "seq": 0, "data": 1},
    {"id": 1, "lease_token": TOKEN, "seq": 1},
    {"id": 1, "lease_token": TOKEN, "seq": 1, "data": 1, "extra": 1},
    {"id": 1, "lease_token": "x", "seq": 1, "data": 1},
    {"id": 1, "lease_token": TOKEN, "seq": 1, "data": "x" * MAX_CHECKPOINT_DATA},
])
def test_a_bad_checkpoint_is_refused(item):
    p = server(9)
    [event] = p.receive(json.dumps({"type": "checkpoint", "checkpoints": [item]}), 0.0)
    assert isinstance(event, FrameRefused) and event.code == ErrorCode.BAD_MESSAGE


# -- the server's rules -----------------------------------------------------------


class Leased:
    def __init__(self, id, lease_token=TOKEN, resume_json=None):
        self.id, self.lease_token, self.kind, self.payload_json, self.attempt = id, lease_token, "train", "{}", 1
        self.resume_json = resume_json


def server(version: int) -> ServerProtocol:
    p = ServerProtocol(max_payload=1 << 20, max_messages_per_second=1000, now=0.0)
    p.receive(encode(Hello("a", ("train",), 2, version)), 0.0)
    p.frames_to_send()
    return p


@pytest.mark.parametrize("version", [8, 9])
def test_resume_from_is_pushed_only_to_an_agent_of_version_9(version):
    p = server(version)
    p.send_jobs([Leased(1, resume_json='{"step":5}'), Leased(2)])
    [frame] = p.frames_to_send()
    pushed = json.loads(frame)["jobs"]
    assert [j.get("resume_from") for j in pushed] == ([{"step": 5}, None] if version == 9 else [None, None])
    assert all("resume_from" not in j for j in pushed[1:])


def test_a_checkpoint_on_a_version_8_connection_is_unexpected():
    p = server(8)
    p.send_jobs([Leased(1)])
    p.frames_to_send()
    [event] = p.receive(encode(Checkpoint((CheckpointItem(1, TOKEN, 1, {"s": 1}),))), 0.0)
    assert isinstance(event, FrameRefused) and event.code == ErrorCode.UNEXPECTED


def test_checkpoints_of_jobs_not_held_with_that_token_are_refused_at_once_the_others_go_to_be_written():
    p = server(9)
    p.send_jobs([Leased(1), Leased(2)])
    p.frames_to_send()
    mine = CheckpointItem(1, TOKEN, 1, {"s": 1})
    frame = encode(Checkpoint((mine, CheckpointItem(2, OTHER, 2, 2), CheckpointItem(3, TOKEN, 3, 3))))
    assert p.receive(frame, 0.0) == [CheckpointsReceived((mine,))]
    assert [json.loads(f) for f in p.frames_to_send()] == [{"type": "checkpointed", "stored": [], "refused": [2, 3]}]
    p.send_checkpointed((1,), ())
    assert json.loads(p.frames_to_send()[0]) == {"type": "checkpointed", "stored": [1], "refused": []}


# -- gpuq.testing -----------------------------------------------------------------


def test_run_job_passes_resume_from_and_shows_the_checkpoints_a_handler_made():
    def train(job):
        start = job.resume_from["step"]
        stored = [job.checkpoint({"step": s}).wait(10) for s in range(start + 1, start + 3)]
        return stored

    outcome = run_job(train, {}, resume_from={"step": 4})
    assert outcome.done and outcome.result == [True, True]
    assert outcome.checkpoints == ({"step": 5}, {"step": 6}) and outcome.stored_checkpoint == {"step": 6}
    untouched = run_job(lambda job: job.resume_from, {})
    assert untouched.result is None and untouched.checkpoints == () and untouched.stored_checkpoint is None


async def test_local_agent_coalesces_by_its_interval_and_refuses_a_cancelled_jobs_checkpoint():
    go = asyncio.Event()

    async def train(job):
        first = await job.checkpoint(1)
        job.checkpoint(2)
        job.checkpoint(3)  # replaces 2 while it waits for the interval
        await go.wait()
        return first

    async with LocalAgent(train, checkpoint_seconds=3600) as local:
        run = local.start({})
        await run.checkpointed(3)
        assert run.stored_checkpoint == 1
        go.set()
        outcome = await run
    assert outcome.result is True and outcome.checkpoints == (1, 2, 3) and outcome.stored_checkpoint == 3

    started = asyncio.Event()

    async def cancelled(job):
        try:
            started.set()
            await asyncio.sleep(3600)
        finally:
            job.checkpoint("after the cancel")

    async with LocalAgent(cancelled) as local:
        run = local.start({})
        await started.wait()
        run.cancel()
        outcome = await run
    assert outcome.cancelled and outcome.checkpoints == ("after the cancel",) and outcome.stored_checkpoint is None
