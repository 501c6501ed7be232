"""Dashboard sessions: signed cookies, roles, expiry, CSRF (gpuq.ui.auth)."""

from gpuq.ui import auth


def test_a_token_opens_its_role_and_nothing_else():
    keys = auth.Keys({"r1"}, {"a1"})
    assert (keys.role_of("r1"), keys.role_of("a1"), keys.role_of("agent-token"), keys.role_of("")) == (
        "read", "admin", None, None)


def test_a_session_cookie_is_checked_signed_and_ends_when_it_expires_or_its_tokens_change():
    keys = auth.Keys({"r1"}, {"a1"})
    cookie = keys.issue("read", now=1000)
    session = keys.session(cookie, now=1000)
    assert session is not None and session.role == "read" and not session.admin
    role, expires, nonce, mac = cookie.split(".")
    assert keys.session(f"admin.{expires}.{nonce}.{mac}", now=1000) is None  # a role cannot be raised
    assert keys.session(f"{role}.{int(expires) + 1}.{nonce}.{mac}", now=1000) is None
    assert keys.session(cookie, now=1000 + auth.SESSION_SECONDS + 1) is None
    assert auth.Keys({"r2"}, {"a1"}).session(cookie, now=1000) is None  # read tokens rotated
    assert auth.Keys({"r1"}, {"a2"}).session(cookie, now=1000) is not None  # admin rotation: not read's
    assert keys.session("garbage", now=1000) is None and keys.session(None, now=1000) is None


def test_the_csrf_token_belongs_to_one_session():
    keys = auth.Keys({"r1"}, {"a1"})
    one = keys.session(keys.issue("admin", 0), 0)
    two = keys.session(keys.issue("admin", 0), 0)
    assert one and two
    assert keys.csrf_ok(one, keys.csrf(one)) and not keys.csrf_ok(two, keys.csrf(one))
    assert not keys.csrf_ok(one, None) and not keys.csrf_ok(one, "")


def test_the_cookie_header_is_read_and_set_with_its_flags():
    assert auth.cookie_value("a=1; gpuq_ui=read.1.n.m; b=2") == "read.1.n.m"
    assert auth.cookie_value(None) is None
    flags = auth.set_cookie("v", secure=True)
    assert "HttpOnly" in flags and "SameSite=Strict" in flags and "Secure" in flags and "Path=/ui" in flags
