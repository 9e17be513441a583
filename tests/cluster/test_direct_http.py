"""The project's own HTTP calls to this host never go through the environment's proxy
(common/cluster/direct_http.py): ``make up``'s health checks and ``pdctl`` against a local gateway went
to ``http_proxy`` when it was set.  Real sockets: a server that answers, and a "proxy" that records
what reaches it."""
from __future__ import annotations

import http.server
import threading
from contextlib import contextmanager

import pytest

from common.cluster.direct_http import urlopen
from pdctl.admin_client import AdminClient


class _Recorder(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (http.server's name)
        self.server.seen.append(self.path)
        body = b'{"workers": []}'
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextmanager
def recorder():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Recorder)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def proxy(monkeypatch):
    with recorder() as server:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        for name in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(name, url)
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        yield server


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
def test_a_loopback_peer_is_reached_directly_with_a_proxy_set(proxy, host):
    with recorder() as gateway:
        url = f"http://{host}:{gateway.server_address[1]}"
        with urlopen(url + "/health", timeout=10) as resp:
            assert resp.status == 200
        assert AdminClient(url, token="t").workers() == []
        assert gateway.seen == ["/health", "/admin/pools"] and proxy.seen == []


def test_another_host_goes_through_the_proxy_the_environment_names(proxy):
    with urlopen("http://pdserve-test.invalid:8000/health", timeout=10) as resp:
        assert resp.status == 200
    assert proxy.seen == ["http://pdserve-test.invalid:8000/health"]  # a proxy's absolute request line


@pytest.mark.parametrize("url", ["http://127.8.0.1:1/x", "http://[::1]:1/x"])
def test_every_loopback_address_is_reached_directly(proxy, url):
    with pytest.raises(OSError):  # nothing listens there: refused at once, not answered by the proxy
        urlopen(url, timeout=10)
    assert proxy.seen == []
