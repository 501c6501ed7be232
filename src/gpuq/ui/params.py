"""What a dashboard request's query string means: each parameter checked, with the error a person reads.

A bad value raises ValueError with that message (the page or action answers
400 with it). Filters become ``JobFilter`` and ``RetryFilter``,
the types the CLI builds from its flags.
"""

from __future__ import annotations

from urllib.parse import parse_qs, urlencode, urlsplit

from gpuq.jobs import JobFilter, RetryFilter
from gpuq.kinds import KIND_RULE, is_kind


def parse(path: str) -> dict[str, str]:
    """The query string's parameters (the last of a repeated one)."""
    return {k: v[-1] for k, v in parse_qs(urlsplit(path).query).items()}


def whole(params: dict[str, str], name: str) -> int | None:
    """A whole-number parameter (blank: None)."""
    text = params.get(name, "").strip()
    if not text:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"{name} must be a whole number, not {text[:30]!r}") from None


def number(params: dict[str, str], name: str) -> float | None:
    """A number parameter (blank: None)."""
    text = params.get(name, "").strip()
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number, not {text[:30]!r}") from None


def checked_kind(kind: str) -> str:
    if not is_kind(kind):
        raise ValueError(f"bad job kind {kind!r}: {KIND_RULE}")
    return kind


def job_id(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 2**63:
        raise ValueError(f"bad job id {text[:30]!r}: a whole number")
    return int(text)


def text_filter(params: dict[str, str], name: str) -> str | None:
    value = params.get(name, "").strip()
    if len(value) > 200:
        raise ValueError(f"{name} filter too long: at most 200 characters")
    return value or None


def job_filter(params: dict[str, str]) -> JobFilter:
    return JobFilter(kind=text_filter(params, "kind"), state=params.get("state") or None,
                           key=text_filter(params, "key"), error=text_filter(params, "error"))


def before(params: dict[str, str]) -> int | None:
    return job_id(params["before"]) if params.get("before") else None


def retry_filter(params: dict[str, str]) -> RetryFilter:
    """One job (``id``), or the dead/cancelled jobs a list's filters match."""
    if params.get("id"):
        return RetryFilter(ids=[job_id(params["id"])])
    which = job_filter(params)
    if which.state not in ("dead", "cancelled", "failed"):
        raise ValueError("retry by filter needs the state dead, cancelled or failed")
    state = None if which.state == "failed" else which.state
    retry = RetryFilter(kind=which.kind, error=which.error, state=state, key=which.key)
    retry.args()
    return retry


def filter_params(which: JobFilter) -> dict[str, str]:
    return {k: v for k, v in (("kind", which.kind), ("state", which.state), ("key", which.key),
                              ("error", which.error)) if v}


def filter_query(which: JobFilter | RetryFilter) -> str:
    if isinstance(which, RetryFilter):
        which = JobFilter(kind=which.kind, state=which.state or "failed", key=which.key, error=which.error)
    return urlencode(filter_params(which))
