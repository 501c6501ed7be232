"""Who may see the dashboard, and do what: tokens, session cookies, CSRF tokens. Pure functions.

- a login presents a token (``Authorization: Bearer``, never in a URL): one
  of ``GPUQ_UI_TOKENS`` opens the dashboard read-only, one of
  ``GPUQ_UI_ADMIN_TOKENS`` with its actions; an agent's token opens nothing;
- the session is a signed cookie ``role.expires.nonce.mac`` (HttpOnly,
  SameSite=Strict): stateless, so any ``gpuq serve`` replica with the same
  tokens accepts it, and changing a role's tokens ends its sessions;
- every action is a POST carrying the session's CSRF token in a header
  (``X-CSRF-Token``), which only a page of this origin can read.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

Role = Literal["read", "admin"]
COOKIE = "gpuq_ui"
SESSION_SECONDS = 12 * 3600


@dataclass(frozen=True, slots=True)
class Session:
    role: Role
    expires: int
    nonce: str

    @property
    def admin(self) -> bool:
        return self.role == "admin"


class Keys:
    """The signing key of each role, derived from its tokens (no key to configure or leak)."""

    def __init__(self, read_tokens: Iterable[str], admin_tokens: Iterable[str]):
        self.tokens: dict[Role, frozenset[str]] = {"read": frozenset(read_tokens), "admin": frozenset(admin_tokens)}
        self._keys = {role: hashlib.sha256(("gpuq-ui|" + role + "|" + ",".join(sorted(t))).encode()).digest()
                      for role, t in self.tokens.items()}

    @property
    def enabled(self) -> bool:
        return any(self.tokens.values())

    def role_of(self, token: str) -> Role | None:
        """The role a login token opens, comparing with every token in constant time."""
        found: Role | None = None
        for role, tokens in self.tokens.items():
            for t in tokens:
                if hmac.compare_digest(token.encode(), t.encode()):
                    found = role
        return found

    def issue(self, role: Role, now: float) -> str:
        expires, nonce = int(now) + SESSION_SECONDS, secrets.token_hex(16)
        return f"{role}.{expires}.{nonce}.{self._mac(role, f'{role}.{expires}.{nonce}')}"

    def session(self, cookie: str | None, now: float) -> Session | None:
        """The session a cookie value proves (None: missing, forged, expired, or its role's tokens changed)."""
        if not cookie or cookie.count(".") != 3:
            return None
        role, expires, nonce, mac = cookie.split(".")
        if role not in ("read", "admin") or not expires.isdigit() or not self.tokens[role]:  # type: ignore[index]
            return None
        if not hmac.compare_digest(mac, self._mac(role, f"{role}.{expires}.{nonce}")):  # type: ignore[arg-type]
            return None
        if int(expires) < now:
            return None
        return Session(role, int(expires), nonce)  # type: ignore[arg-type]

    def csrf(self, session: Session) -> str:
        return self._mac(session.role, "csrf." + session.nonce)

    def csrf_ok(self, session: Session, presented: str | None) -> bool:
        return bool(presented) and hmac.compare_digest(presented or "", self.csrf(session))

    def _mac(self, role: Role, text: str) -> str:
        return hmac.new(self._keys[role], text.encode(), hashlib.sha256).hexdigest()


def cookie_value(header: str | None) -> str | None:
    """The session cookie's value in a ``Cookie`` header."""
    for part in (header or "").split(";"):
        name, _, value = part.strip().partition("=")
        if name == COOKIE:
            return value
    return None


def set_cookie(value: str, secure: bool) -> str:
    return (f"{COOKIE}={value}; Path=/ui; HttpOnly; SameSite=Strict; Max-Age={SESSION_SECONDS}"
            + ("; Secure" if secure else ""))
