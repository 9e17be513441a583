"""HTTP calls that never go through the environment's proxy where the peer is on this host.

``urllib.request.urlopen`` sends every request through ``http_proxy`` when the variable is set and
``no_proxy`` does not name the host -- loopback included -- so behind a corporate proxy the launcher's
health checks of its own processes, and ``pdctl`` against a local gateway, went to the proxy (which
cannot reach this host's 127.0.0.1, and should not see an admin token).  ``urlopen`` here opens a
loopback (or ``localhost``) URL directly and any other as the environment says.
"""
from __future__ import annotations

import urllib.parse
import urllib.request

from common.cluster.auth import is_loopback

_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def urlopen(request: urllib.request.Request | str, timeout: float):
    """``urllib.request.urlopen`` that bypasses proxies for a loopback peer."""
    url = request.full_url if isinstance(request, urllib.request.Request) else request
    if is_loopback(urllib.parse.urlsplit(url).hostname or ""):
        return _DIRECT.open(request, timeout=timeout)
    return urllib.request.build_opener().open(request, timeout=timeout)  # the environment's proxies, read now
