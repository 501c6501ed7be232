"""An agent on a spot (preemptible) instance that watches the cloud's metadata for the interruption notice.

    python examples/spot_watcher.py ws://127.0.0.1:8765/agent --token s3cret --cloud aws
    python examples/spot_watcher.py ws://127.0.0.1:8765/agent --token s3cret --cloud gcp
    python examples/spot_watcher.py ws://127.0.0.1:8765/agent --token s3cret --metadata-url http://127.0.0.1:9999/notice

When the notice comes, the watcher calls ``agent.interrupt(notice_seconds)``:
the agent takes no new work, gives back the jobs it holds ready at once, and
asks its running preemptible jobs to yield within the notice less a margin;
they save where they got to and go back to pending without counting the
attempt, to resume on another agent. The agent exits by the notice.

The endpoints (gpuq itself makes no cloud calls; this example does, only
where you point it):

- AWS EC2 spot: ``http://169.254.169.254/latest/meta-data/spot/instance-action``
  answers 404 until the two-minute warning, then 200 with
  ``{"action": "terminate", "time": "..."}`` (IMDSv2 wants a token from
  ``PUT /latest/api/token`` first: ``--imds-token``). Notice: 120 s.
- GCP spot / preemptible VMs:
  ``http://metadata.google.internal/computeMetadata/v1/instance/preempted``
  with the header ``Metadata-Flavor: Google`` answers ``FALSE``, then
  ``TRUE``. Notice: 30 s.

Without a watcher, ``gpuq agent --interruption-notice SECONDS`` does the same
on SIGTERM (a node termination handler's, or Kubernetes' on a spot node).

The handler is a stand-in for training: ``steps`` steps of ``step_seconds``,
reporting its progress; asked to yield, it stops between two steps (a real
one saves a checkpoint first) and raises ``JobPreempted``:

    gpuq enqueue train '{"steps": 6000, "step_seconds": 0.01}' --preemptible --grace 60
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import urllib.error
import urllib.request
from typing import Any

from gpuq.agent import Agent, JobPreempted

CLOUDS = {  # the metadata endpoint, its headers, and the notice the cloud gives (seconds)
    "aws": ("http://169.254.169.254/latest/meta-data/spot/instance-action", {}, 120.0),
    "gcp": ("http://metadata.google.internal/computeMetadata/v1/instance/preempted",
            {"Metadata-Flavor": "Google"}, 30.0),
}


async def train(job: Any) -> dict[str, int]:
    """Run the job's steps from where its payload (or, with checkpoints, ``job.resume_from``) says."""
    steps, step = job.payload["steps"], job.payload.get("from_step", 0)
    while step < steps:
        if job.preempted:  # a real one saves its weights and the step here, to resume from
            raise JobPreempted(f"yielded at step {step}")
        await asyncio.sleep(job.payload.get("step_seconds", 0.01))  # one step of training
        step += 1
        if step % 100 == 0:
            job.progress(step / steps, f"step {step}/{steps}")
    return {"steps": step}


def notice_given(url: str, headers: dict[str, str], timeout: float = 2.0) -> bool:
    """Whether the metadata endpoint says the instance is being reclaimed: a 200 whose body is
    not empty nor ``FALSE`` (AWS: 404 until then; GCP: ``FALSE`` until then)."""
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
            return r.status == 200 and r.read().strip().upper() not in (b"", b"FALSE")
    except (urllib.error.URLError, OSError):  # 404, or the endpoint is not there (yet): no notice
        return False


async def watch(agent: Agent, url: str, headers: dict[str, str], notice_seconds: float, every: float) -> None:
    """Poll the endpoint until it gives notice, then interrupt the agent (on its event loop)."""
    while not await asyncio.to_thread(notice_given, url, headers):
        await asyncio.sleep(every)
    agent.interrupt(notice_seconds)


async def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("url", help="the server's websocket URL")
    p.add_argument("--token", required=True)
    p.add_argument("--kinds", default="train")
    p.add_argument("--capacity", type=int, default=1)
    p.add_argument("--name", default="spot")
    p.add_argument("--cloud", choices=sorted(CLOUDS), default="aws")
    p.add_argument("--metadata-url", help="the endpoint to watch (default: the cloud's)")
    p.add_argument("--imds-token", help="AWS IMDSv2 session token (X-aws-ec2-metadata-token)")
    p.add_argument("--notice", type=float, help="seconds of notice (default: the cloud's)")
    p.add_argument("--poll-seconds", type=float, default=1.0)
    args = p.parse_args(argv)
    url, headers, notice = CLOUDS[args.cloud]
    if args.imds_token:
        headers = {**headers, "X-aws-ec2-metadata-token": args.imds_token}
    agent = Agent(args.url, args.token, args.kinds.split(","), args.capacity, train, args.name, devices=())
    watcher = asyncio.create_task(watch(agent, args.metadata_url or url, headers, args.notice or notice,
                                        args.poll_seconds))
    try:
        await agent.run_until_signal()
    finally:
        watcher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await watcher


if __name__ == "__main__":
    asyncio.run(main())
