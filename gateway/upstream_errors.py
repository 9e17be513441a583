"""How a call to a decode worker fails, as the dispatcher (gateway/dispatch.py) tells the cases apart."""
from __future__ import annotations


class UpstreamError(Exception):
    """The request failed inside the cluster after it was accepted (the client gets ``status``)."""

    status = 500


class WorkerAnswerError(UpstreamError):
    """No decode worker gave an answer the gateway can read: an error page (the worker's auth
    middleware's JSON, aiohttp's plain-text 500, a proxy's HTML) or bytes that are no frame
    stream.  A failure of the cluster, never of the client's request."""

    status = 502


class UpstreamTimeout(Exception):
    """A decode worker did not answer, or stopped sending, within its timeout."""


class BadAnswer(Exception):
    """A decode worker's answer that is no frame stream.  ``worker_fault``: a 5xx (or a 2xx/3xx
    that is not frames) says the worker or a proxy before it is broken, and benches it; a 4xx
    says it refused this request (too large for it, say), which excludes it for this request
    only -- a client must not be able to bench workers with its requests."""

    def __init__(self, status: int, content_type: str, what: str, excerpt: bytes = b""):
        super().__init__(f"decode worker answered {status} {content_type or '(no content type)'}: {what}")
        self.status = status
        self.excerpt = excerpt
        self.worker_fault = not 400 <= status < 500

    def detail(self) -> str:
        """The message and an excerpt of the body, printable, for the log (not the client)."""
        text = printable(self.excerpt)
        return f"{self}{f' ({text!r})' if text else ''}"


def printable(excerpt: bytes) -> str:
    """A peer's bytes as text fit for a log line (control characters blanked)."""
    text = excerpt.decode("utf-8", "replace")
    return "".join(c if c.isprintable() else " " for c in text).strip()


class HandedOver(Exception):
    """The decode worker drains and handed the stream over (a "migrate" frame)."""


class RetryElsewhere(Exception):
    """The decode worker refused before starting; another one may take the request."""

    def __init__(self, reason: str, stale_view: bool):
        super().__init__(reason)
        self.stale_view = stale_view
