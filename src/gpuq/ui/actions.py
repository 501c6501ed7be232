"""What an admin can do from the dashboard: each action is the CLI's own function, so the two cannot disagree.

An action takes the pool and the request's query parameters, checks them
(``params``: a bad one raises ValueError, answered 400) and returns the HTTP
status and the text that goes beside the button or form ("" with 204). The
HTTP side (``web``) checks the session, the CSRF token and the role first.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from gpuq import admin, logs, quarantine, schedules
from gpuq.batches import describe
from gpuq.ui import params, views

log = logs.get("ui")

Outcome = tuple[HTTPStatus, str]
DONE: Outcome = (HTTPStatus.NO_CONTENT, "")


async def pause(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq pause``."""
    kind = params.checked_kind(query.get("kind", ""))
    await admin.pause(pool, kind, by="dashboard")
    log.info("ui.action", action="pause", kind=kind)
    return DONE


async def resume(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq resume``."""
    kind = params.checked_kind(query.get("kind", ""))
    await admin.resume(pool, kind)
    log.info("ui.action", action="resume", kind=kind)
    return DONE


async def cancel(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq cancel ID``: 409 if the job is no longer live."""
    job_id = params.job_id(query.get("id", ""))
    cancelled = await admin.cancel(pool, job_id)
    log.info("ui.action", action="cancel", job_id=job_id, cancelled=bool(cancelled))
    if not cancelled:
        return HTTPStatus.CONFLICT, f"job {job_id} is not live (finished, or no such job)\n"
    return DONE


async def preempt(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq preempt ID``: 409 if the job is not asked (not running, not preemptible, no preemptions
    left, or asked within its grace time)."""
    job_id = params.job_id(query.get("id", ""))
    asked = await admin.preempt(pool, job_id)
    log.info("ui.action", action="preempt", job_id=job_id, preempted=bool(asked))
    if not asked:
        return HTTPStatus.CONFLICT, (f"job {job_id} is not preempted (not running, not preemptible, no "
                                     "preemptions left, or asked already)\n")
    return DONE


async def retry(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq retry``: one job (``id``) or every dead or cancelled job a list's filters match."""
    which = params.retry_filter(query)
    n = await admin.retry(pool, which)
    log.info("ui.action", action="retry", jobs=n, ids=which.ids, kind=which.kind, state=which.state,
             key=which.key, error=which.error)
    return HTTPStatus.OK, f"{n} job{'' if n == 1 else 's'} sent back to pending"


async def add_schedule(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq schedule add``: name, cron, kind, payload (JSON), priority, max_attempts."""
    try:
        payload = json.loads(query["payload"]) if query.get("payload", "").strip() else None
    except json.JSONDecodeError as exc:
        raise ValueError(f"payload is not JSON: {exc}") from None
    priority, attempts = params.whole(query, "priority"), params.whole(query, "max_attempts")
    schedule = schedules.Schedule(query.get("name", "").strip(), query.get("cron", "").strip(),
                                  query.get("kind", "").strip(), payload, 0 if priority is None else priority,
                                  5 if attempts is None else attempts)
    first = await schedules.add(pool, schedule, by="dashboard")
    log.info("ui.action", action="add_schedule", schedule=schedule.name, cron=schedule.cron, kind=schedule.kind)
    return HTTPStatus.OK, f"{schedule.name}: first run at {views.when(first, seconds=True)}"


async def remove_schedule(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq schedule remove``: 404 if there is no such schedule."""
    name = query.get("name", "")
    removed = await schedules.remove(pool, name)
    log.info("ui.action", action="remove_schedule", schedule=name, removed=removed)
    return DONE if removed else (HTTPStatus.NOT_FOUND, f"no schedule {name[:100]!r}\n")


async def set_limit(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq limit``: at most ``max`` leased at once per kind or key; no ``max``: no limit."""
    scope, name, most = query.get("scope", ""), query.get("name", "").strip(), params.whole(query, "max")
    await admin.set_limit(pool, scope, name, most)
    log.info("ui.action", action="set_limit", scope=scope, name=name, max_running=most)
    return HTTPStatus.OK, f"{scope} {name}: " + ("no limit" if most is None else f"at most {most} at once")


async def set_timeout(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq kind-timeout``: the default seconds per attempt of a kind's jobs; none: no default."""
    kind, seconds = query.get("kind", "").strip(), params.whole(query, "seconds")
    await admin.set_kind_timeout(pool, kind, seconds)
    log.info("ui.action", action="set_timeout", kind=kind, seconds=seconds)
    return HTTPStatus.OK, f"{kind}: " + ("no default timeout" if seconds is None else f"{seconds} s")


async def set_batching(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq batch KIND --max-items N [--max-wait-ms MS] [--max-cost C]``: sets or replaces the kind's policy
    (blank max_wait_ms: 0, blank max_cost: no budget); ``admin.set_batching`` checks the ranges."""
    kind, items = query.get("kind", "").strip(), params.whole(query, "max_items")
    wait, cost = params.whole(query, "max_wait_ms") or 0, params.whole(query, "max_cost")
    if items is None:  # None would remove the policy: that is the Remove button's
        raise ValueError("give max_items: the most jobs in one batch (Remove takes a policy away)")
    await admin.set_batching(pool, kind, items, wait, cost)
    log.info("ui.action", action="set_batching", kind=kind, max_items=items, max_wait_ms=wait, max_cost=cost)
    policy = {"kind": kind, "max_items": items, "max_wait_ms": wait, "max_cost": cost}
    return HTTPStatus.OK, describe(policy)


async def remove_batching(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq batch KIND none``: the kind's jobs go one by one again (no policy: nothing to do)."""
    kind = query.get("kind", "").strip()
    await admin.set_batching(pool, kind, None)
    log.info("ui.action", action="remove_batching", kind=kind)
    return DONE


async def set_tenant(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq tenant set NAME --weight W``: sets or replaces the tenant's weight (fair share goes on)."""
    name, weight = query.get("name", "").strip(), params.number(query, "weight")
    if weight is None:  # None would remove the weight: that is the Remove button's
        raise ValueError("give a weight, more than 0 (Remove takes a weight away)")
    await admin.set_tenant(pool, name, weight)
    log.info("ui.action", action="set_tenant", tenant=name, weight=weight)
    return HTTPStatus.OK, f"{name}: weight {weight:g}"


async def remove_tenant(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq tenant set NAME none``: the tenant weighs 1 again (no weight left: fair share goes off)."""
    name = query.get("name", "").strip()
    await admin.set_tenant(pool, name, None)
    log.info("ui.action", action="remove_tenant", tenant=name)
    return DONE


async def clear_device(pool: Any, query: dict[str, str]) -> Outcome:
    """``gpuq device clear AGENT:INDEX`` (or ``AGENT``: all of its devices): 404 if none was quarantined."""
    device = query.get("device", "").strip()
    agent, index = quarantine.parse_device(device)
    cleared = await quarantine.clear(pool, agent, index)
    log.info("ui.action", action="clear_device", device=device, cleared=cleared)
    return DONE if cleared else (HTTPStatus.NOT_FOUND, f"{device[:100]}: not quarantined\n")


ACTIONS: dict[str, Callable[[Any, dict[str, str]], Awaitable[Outcome]]] = {
    "/ui/kinds/pause": pause, "/ui/kinds/resume": resume, "/ui/jobs/cancel": cancel, "/ui/jobs/retry": retry,
    "/ui/jobs/preempt": preempt,
    "/ui/schedules/add": add_schedule, "/ui/schedules/remove": remove_schedule,
    "/ui/limits/set": set_limit, "/ui/timeouts/set": set_timeout,
    "/ui/batching/set": set_batching, "/ui/batching/remove": remove_batching,
    "/ui/tenants/set": set_tenant, "/ui/tenants/remove": remove_tenant,
    "/ui/devices/clear": clear_device,
}

