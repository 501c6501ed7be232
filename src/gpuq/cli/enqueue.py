"""``gpuq enqueue``: one job from the command line, or JSON lines from stdin in batches."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from gpuq import config
from gpuq.cli.database import on_db
from gpuq.cli.errors import CLIError
from gpuq.cli.values import json_arg
from gpuq.jobs import DEFAULT_GRACE_SECONDS, DEFAULT_MAX_PREEMPTIONS


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = sub.add_parser("enqueue", help="enqueue a job, or JSON lines from stdin with --stdin")
    e.add_argument("kind", nargs="?", help="job kind (routing key)")
    e.add_argument("payload", nargs="?", default="{}", help="JSON payload (default {})")
    e.add_argument("--priority", type=int, default=0, help="higher runs first (default 0)")
    e.add_argument("--max-attempts", type=int, default=5, help="attempts before dead (default 5)")
    e.add_argument("--delay", type=float, default=0.0, help="seconds before the job may run")
    e.add_argument("--dedup-key", help="skip if a live job has this key (prints the live job's id)")
    e.add_argument("--timeout", type=int, default=None,
                   help="seconds one attempt may run; then it fails with 'timeout' (default: no limit)")
    e.add_argument("--gpus", type=int, default=0, help="GPUs the job takes, on one agent (default 0)")
    e.add_argument("--gpu-memory", type=int, default=None, metavar="MIB",
                   help="the least memory of each of those GPUs, MiB")
    e.add_argument("--labels", default="", help="comma-separated labels the agent must have (gpu=h100,...)")
    e.add_argument("--model", default=None, help="the model it would rather find warm on its agent")
    e.add_argument("--concurrency-key", default=None, help="what global limits count it under (a tenant, ...)")
    e.add_argument("--cost", type=int, default=None,
                   help="its share of a batch's --max-cost (tokens, pixels; see gpuq batch)")
    e.add_argument("--batch-key", default=None, help="only jobs of one batch key share a batch (a length bucket, ...)")
    e.add_argument("--tenant", default=None,
                   help="whose GPU-seconds it charges under fair share (default: the default tenant; see gpuq tenant)")
    e.add_argument("--preemptible", action="store_true",
                   help="it may be asked to yield (gpuq preempt, a higher-priority job, a spot interruption): it goes "
                        "back to pending without counting the attempt")
    e.add_argument("--grace", type=float, default=DEFAULT_GRACE_SECONDS, metavar="SECONDS",
                   help=f"a preemptible job's time to stop once asked (default {DEFAULT_GRACE_SECONDS:g})")
    e.add_argument("--max-preemptions", type=int, default=DEFAULT_MAX_PREEMPTIONS,
                   help=f"preemptions before it runs to its end (default {DEFAULT_MAX_PREEMPTIONS})")
    e.add_argument("--stdin", action="store_true",
                   help='bulk: one JSON object per line, {"kind": ..., "payload": ..., "priority": ...}; '
                        "the flags' names (gpus, gpu_memory_mb, labels, model, concurrency_key, cost, batch_key, tenant, "
                        "preemptible, grace, max_preemptions) too")
    e.add_argument("--batch", type=int, default=1000, help="rows per INSERT with --stdin (default 1000)")
    config.add_flags(e, "enqueue")
    e.set_defaults(func=cmd_enqueue)


def cmd_enqueue(args: argparse.Namespace) -> int:
    from gpuq import queue
    from gpuq.jobs import NewJob

    if args.stdin:
        if args.kind:
            raise CLIError("give either a kind and payload, or --stdin, not both")
        return _enqueue_stdin(args)
    if not args.kind:
        raise CLIError("missing job kind (or use --stdin)")
    try:
        job = NewJob.from_mapping({
            "kind": args.kind, "payload": json_arg(args.payload, "payload"), "priority": args.priority,
            "max_attempts": args.max_attempts, "delay": args.delay, "dedup_key": args.dedup_key,
            "timeout": args.timeout, "gpus": args.gpus, "gpu_memory_mb": args.gpu_memory,
            "labels": config.parse_list(args.labels, "--labels"), "model": args.model,
            "concurrency_key": args.concurrency_key, "cost": args.cost, "batch_key": args.batch_key,
            "tenant": args.tenant, "preemptible": args.preemptible, "grace": args.grace,
            "max_preemptions": args.max_preemptions})
    except ValueError as exc:
        raise CLIError(str(exc)) from None

    print(on_db(args, lambda conn: queue.enqueue_many(conn, [job]))[0])
    return 0


def _enqueue_stdin(args: argparse.Namespace) -> int:
    from gpuq import queue
    from gpuq.jobs import NewJob

    def parse(lineno: int, line: str) -> NewJob:
        try:
            return NewJob.from_mapping(json_arg(line, f"stdin line {lineno}"))
        except ValueError as exc:
            raise CLIError(f"stdin line {lineno}: {exc}") from None

    async def run(conn: Any) -> int:
        total, batch = 0, []
        for lineno, line in enumerate(sys.stdin, 1):
            if line.strip():
                batch.append(parse(lineno, line))
            if len(batch) >= args.batch:
                total += len(await queue.enqueue_many(conn, batch))
                batch = []
                print(f"enqueued {total}", file=sys.stderr)
        if batch:
            total += len(await queue.enqueue_many(conn, batch))
        return total

    print(f"enqueued {on_db(args, run)} jobs")
    return 0
