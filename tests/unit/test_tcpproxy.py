"""The black-hole proxy: passes bytes on, then holds them without closing, then passes them again."""

import socket
import socketserver
import threading
import time

import pytest

from gpuq.tcpproxy import TcpProxy


class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        while data := self.request.recv(4096):
            self.request.sendall(data)


@pytest.fixture
def echo_port():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


def _roundtrip(sock, data=b"ping"):
    sock.sendall(data)
    return sock.recv(4096)


def test_a_black_hole_holds_bytes_on_open_and_new_connections_and_closes_nothing(echo_port):
    with TcpProxy(echo_port) as proxy:
        old = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        assert _roundtrip(old) == b"ping"
        proxy.black_hole()
        old.settimeout(0.3)
        with pytest.raises(TimeoutError):
            _roundtrip(old)  # sent and acknowledged, never answered, never closed
        new = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)  # still accepts
        new.settimeout(0.3)
        with pytest.raises(TimeoutError):
            _roundtrip(new)
        proxy.forward()
        old.settimeout(5)
        new.settimeout(5)
        assert old.recv(4096) == b"ping"  # what was held back goes on
        assert new.recv(4096) == b"ping"
        assert _roundtrip(old, b"again") == b"again"
        old.close()
        new.close()


def test_closing_the_proxy_closes_its_connections(echo_port):
    proxy = TcpProxy(echo_port).start()
    sock = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    assert _roundtrip(sock) == b"ping"
    proxy.close()
    try:
        assert sock.recv(4096) == b""
    except ConnectionResetError:
        pass  # closed with a reset: as closed


def test_closing_a_black_hole_leaves_no_connection_pending(echo_port):
    """Connections held by a black hole end with close(), not as "Task was destroyed" when the process exits."""
    import asyncio

    proxy = TcpProxy(echo_port).start()
    held = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
    assert _roundtrip(held) == b"ping"
    proxy.black_hole()
    new = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)  # accepted, held before upstream
    held.sendall(b"x")
    new.sendall(b"y")
    proxy.close()
    assert not [t for t in asyncio.all_tasks(proxy._loop) if not t.done()]
    held.close()
    new.close()


def test_closing_a_black_hole_prints_no_traceback(echo_port, caplog):
    proxy = TcpProxy(echo_port).start()
    proxy.black_hole()
    held = [socket.create_connection(("127.0.0.1", proxy.port), timeout=5) for _ in range(3)]
    deadline = time.monotonic() + 5
    while len(proxy._writers) < 3 and time.monotonic() < deadline:  # accepted, held in the hole
        time.sleep(0.01)
    proxy.close()
    for sock in held:
        sock.close()
    assert not [r for r in caplog.records if "Exception in callback" in r.getMessage()]
