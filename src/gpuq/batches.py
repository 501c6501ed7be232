"""Batch rules: which of a kind's next jobs go together in one handler call. Pure functions.

The rules (docs/design.md, "Batching"):

- only jobs of one ``batch_key`` share a batch (NULL is a key of its own),
  and of one timeout: a batch runs under its items' smallest, so a job with a
  short one must not cut its batch-mates' attempts short;
- a batch holds at most ``max_items`` jobs, and their costs (NULL counts 0)
  sum to at most ``max_cost`` when the policy has one; a job whose cost alone
  is over it runs alone, so it never waits for a batch that cannot come;
- jobs keep their lease order (priority, then id) inside a batch, and batches
  go in the order of their first job, so batching never lets a later job
  overtake an earlier one of the same key;
- a batch is *closed* when nothing more could join it (``max_items`` reached,
  or the next job of its key would go over ``max_cost``); an open one is
  partial: it goes once its oldest job has waited ``max_wait_ms`` (``due_in``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Policy:
    """A kind's batching policy (gpuq.batch_policies)."""

    max_items: int
    max_wait_ms: int = 0
    max_cost: int | None = None



def describe(policy: Mapping[str, Any]) -> str:
    """A kind's policy (``{kind, max_items, max_wait_ms, max_cost}``) as the CLI and the dashboard say it:
    ``embed: at most 64 a batch, a partial one after 10 ms, cost <= 8192``."""
    wait = f"a partial one after {policy['max_wait_ms']} ms" if policy["max_wait_ms"] else "a partial one at once"
    cost = f", cost <= {policy['max_cost']}" if policy["max_cost"] is not None else ""
    return f"{policy['kind']}: at most {policy['max_items']} a batch, {wait}{cost}"

@dataclass(frozen=True, slots=True)
class Head:
    """One of a kind's next pending jobs, as the batch rules read it."""

    id: int
    cost: int | None
    batch_key: str | None
    waited_ms: int  # since it was due (its run_at)
    timeout: int | None = None  # seconds its attempt will have (its own, else its kind's; None: no limit)


@dataclass(slots=True)
class Batch:
    jobs: list[Head] = field(default_factory=list)
    cost: int = 0
    closed: bool = False

    @property
    def waited_ms(self) -> int:
        """How long its oldest job has waited."""
        return max(j.waited_ms for j in self.jobs)


def form(head: Iterable[Head], max_items: int, max_cost: int | None) -> list[Batch]:
    """The batches ``head`` (in lease order) makes, in the order of their first job."""
    batches: list[Batch] = []
    open_by_key: dict[tuple[str | None, int | None], Batch] = {}
    for job in head:
        cost, key = job.cost or 0, (job.batch_key, job.timeout)
        batch = open_by_key.get(key)
        if batch is not None and max_cost is not None and batch.cost + cost > max_cost:
            batch.closed = True  # the next of its key does not fit: nothing more joins it
            batch = None
        if batch is None:
            batch = open_by_key[key] = Batch()
            batches.append(batch)
        batch.jobs.append(job)
        batch.cost += cost
        if len(batch.jobs) >= max_items or (max_cost is not None and batch.cost >= max_cost):
            batch.closed = True
            del open_by_key[key]
    return batches


def ready(batches: Sequence[Batch], max_wait_ms: int) -> tuple[list[Batch], int | None]:
    """The batches that may go now (closed, or whose oldest job waited ``max_wait_ms``), and in how
    many milliseconds the next partial one may (None: none waits)."""
    go, due_in = [], None
    for b in batches:
        left = 0 if b.closed else max_wait_ms - b.waited_ms
        if left <= 0:
            go.append(b)
        else:
            due_in = left if due_in is None else min(due_in, left)
    return go, due_in
