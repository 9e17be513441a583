"""Connecting to Redis, and starting a private one when none is running.

Redis holds the worker registry and the prefix-cache index.  Both are hints for routing, so every
client here fails fast: a short connect/read timeout and a single retry (enough to ride over a
pooled connection that a Redis restart left stale), never redis-py's default of ten retries with
back-off, which would stall a request for seconds while Redis is down.

``ensure_redis(url)`` is what ``make up`` and the test suite call: if something answers at ``url``
it is used; if not and the address is local, a private ``redis-server`` is started on a free port
(no persistence, in a temp dir) and its URL returned together with a handle that stops it.

Run ``python -m common.cluster.redis_util`` to print a usable URL (starting a private server if needed and
keeping it up until interrupted).
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff

from common.cluster.ports import free_port
from common.cluster.children import die_with_parent
from common.cluster.redis_keys import DEFAULT_KEY_PREFIX, KEY_PREFIX_RE
from common.cluster.secret_sources import read_secret_file

log = logging.getLogger(__name__)
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379"
LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})
# Errors that mean "Redis is not reachable right now" (as opposed to a bug in our command).
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.BusyLoadingError,
    ConnectionError,
    TimeoutError,
    OSError,
)


@dataclass(frozen=True)
class RedisConfig:
    """Where Redis is and how this deployment's keys are named.

    ``key_prefix`` separates deployments (and tests) sharing one Redis; ``heartbeat_ttl_s`` is how
    long a worker's registry entry and prefix-index entries outlive its last heartbeat.  Its repr
    shows the URL without credentials.
    """

    url: str = DEFAULT_REDIS_URL
    key_prefix: str = DEFAULT_KEY_PREFIX
    heartbeat_ttl_s: float = 5.0
    timeout_s: float = 1.0

    def __post_init__(self) -> None:
        _check_url(self.url)
        if not KEY_PREFIX_RE.fullmatch(self.key_prefix):
            raise ValueError(f"key_prefix {self.key_prefix!r}: use 1-64 of [A-Za-z0-9._:-]")
        if not 0 < self.heartbeat_ttl_s <= 3600:
            raise ValueError(f"heartbeat_ttl_s must be in (0, 3600], got {self.heartbeat_ttl_s}")
        if not 0 < self.timeout_s <= 60:
            raise ValueError(f"timeout_s must be in (0, 60], got {self.timeout_s}")

    def __repr__(self) -> str:
        return (f"RedisConfig(url={redact_url(self.url)!r}, key_prefix={self.key_prefix!r}, "
                f"heartbeat_ttl_s={self.heartbeat_ttl_s!r}, timeout_s={self.timeout_s!r})")

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> "RedisConfig":
        """Read ``REDIS_URL``, ``PDSERVE_KEY_PREFIX``, ``PDSERVE_HEARTBEAT_TTL_S``, ``PDSERVE_REDIS_TIMEOUT_S``."""
        env = os.environ if env is None else env

        def num(name: str, default: float) -> float:
            raw = env.get(name)
            if raw is None or raw == "":
                return default
            try:
                return float(raw)
            except ValueError:
                raise ValueError(f"{name}={raw!r} is not a number") from None

        return cls(
            url=redis_url_from_env(env),
            key_prefix=env.get("PDSERVE_KEY_PREFIX") or DEFAULT_KEY_PREFIX,
            heartbeat_ttl_s=num("PDSERVE_HEARTBEAT_TTL_S", 5.0),
            timeout_s=num("PDSERVE_REDIS_TIMEOUT_S", 1.0),
        )


class RedisUnavailableError(RuntimeError):
    """Nothing usable answers at the Redis URL, and no private server could be started."""


def redis_url_from_env(env: dict[str, str] | None = None) -> str:
    """The Redis URL from ``REDIS_URL``, else :data:`DEFAULT_REDIS_URL`."""
    env = os.environ if env is None else env
    return env.get("REDIS_URL") or DEFAULT_REDIS_URL


_PASSWORD_PARAM = re.compile(r"(?i)([?&;]password=)[^&;#]*")


def redact_url(url: str) -> str:
    """``url`` fit to print: credentials (``user:password@``, a ``password=`` query parameter)
    replaced by ``***``.  Works on malformed URLs too: everything up to the last ``@`` after the
    scheme goes, so a password that holds ``/``, ``#`` or ``@`` does not leak either."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    if "@" in rest:
        rest = "***@" + rest.rsplit("@", 1)[1]
    rest = _PASSWORD_PARAM.sub(r"\1***", rest)
    return f"{scheme}{sep}{rest}"


def with_password(url: str, password: str) -> str:
    """``url`` with ``password`` in it (percent-encoded), for a password read from a file; raises
    ValueError when the URL carries a password already (two sources: say which one is meant)."""
    _check_url(url)
    parts = urlsplit(url)
    if parts.password or _PASSWORD_PARAM.search(url):
        raise ValueError(f"REDIS_URL {redact_url(url)} already holds a password; give it there or in the "
                         f"password file, not both")
    user = quote(parts.username or "", safe="")
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{user}:{quote(password, safe='')}@{host}"))


def redis_url_with_password_file(url: str, password_file: str | None) -> str:
    """``url``, with the password read from ``password_file`` (``--redis-password-file``) when given."""
    if not password_file:
        return url
    return with_password(url, read_secret_file(password_file, "the Redis password"))


def warn_password_on_command_line(url: str, flag: str | None) -> None:
    """Log a warning (naming ``flag``, not the password) when a URL with a password came from the
    command line (``flag`` is the flag that set it, or None)."""
    if flag and (urlsplit(url).password or _PASSWORD_PARAM.search(url)):
        log.warning("the Redis password was given on the command line (%s): every user of this machine can read a "
                    "process's command line; set REDIS_URL in the environment or put the password in a file "
                    "(--redis-password-file)", flag)


def _check_url(url: str) -> None:
    """Raise ValueError (without the URL's credentials) unless ``url`` is a usable Redis URL."""
    shown = redact_url(url)
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises on a port that is not a number
    except ValueError:  # not echoed: a password typed where the port goes would be in the message
        raise ValueError("REDIS_URL is malformed: its port must be a number in 0-65535 and an IPv6 host "
                         "needs [brackets] (redis://[:password@]host[:port][/db])") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"REDIS_URL {shown}: scheme must be redis://, rediss:// or unix://")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"REDIS_URL {shown} has no host")


RESP_PROTOCOL = 2
"""The Redis wire protocol version every client of the project speaks (see :func:`connect`)."""


def connect(url: str | None = None, *, timeout_s: float = 1.0) -> aioredis.Redis:
    """An asyncio Redis client for ``url`` (default: ``REDIS_URL``) that fails fast.

    Replies are raw ``bytes`` (block hashes are binary); callers decode what they need.  The client
    speaks RESP2 whatever its library defaults to (redis-py 8 defaults to RESP3, which changes
    reply shapes and sends ``HELLO`` first): the replies callers parse stay one shape, and servers
    older than Redis 6 (no ``HELLO``) still answer.
    """
    url = url or redis_url_from_env()
    _check_url(url)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    return aioredis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=AsyncRetry(ExponentialBackoff(cap=0.05, base=0.01), retries=1),
        decode_responses=False,
        protocol=RESP_PROTOCOL,
    )


def ping(url: str, *, timeout_s: float = 0.5) -> bool:
    """True when a Redis server answers PING at ``url`` (synchronous, for start-up code)."""
    client = redis.Redis.from_url(
        url,
        socket_connect_timeout=timeout_s,
        socket_timeout=timeout_s,
        retry=None,
        protocol=RESP_PROTOCOL,
    )
    try:
        return bool(client.ping())
    except UNAVAILABLE_ERRORS:
        return False
    except redis.exceptions.ResponseError:
        # Something answers but refuses PING (e.g. needs AUTH): it is a Redis, not ours to replace.
        return True
    finally:
        client.close()


class RedisServer:
    """A private ``redis-server`` child process: no persistence, loopback only, in a temp dir.

    ``stop()`` kills it and removes the dir; ``kill()`` + ``start()`` simulate a Redis crash and
    restart on the same port (all data lost), which the fault tests use.
    """

    def __init__(self, port: int | None = None, *, executable: str | None = None) -> None:
        self.executable = executable or shutil.which("redis-server")
        if self.executable is None:
            raise RedisUnavailableError(
                "redis-server is not installed. Install it (Debian/Ubuntu: `apt-get install "
                "redis-server`) or point REDIS_URL at a running Redis (e.g. REDIS_URL=redis://host:6379)."
            )
        self.port = port or free_port()
        self.dir = tempfile.mkdtemp(prefix="pdserve-redis-")
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, "redis.log")

    def start(self, timeout_s: float = 10.0) -> "RedisServer":
        """Start the server and return once it answers PING; raises if it exits or never answers."""
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"redis-server on port {self.port} is already running")
        args = [
            self.executable, "--port", str(self.port), "--bind", "127.0.0.1",
            "--save", "", "--appendonly", "no", "--dir", self.dir,
            "--logfile", self.log_path, "--daemonize", "no",
        ]
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True,
                                     preexec_fn=die_with_parent())  # dies with us, even SIGKILLed
        deadline = time.monotonic() + timeout_s
        # A child process's readiness is not awaitable, so poll PING until the deadline.
        while not ping(self.url, timeout_s=0.2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RedisUnavailableError(
                    f"private redis-server on port {self.port} did not start: {self._log_tail()}"
                )
            time.sleep(0.02)
        return self

    def kill(self) -> None:
        """SIGKILL the server (a crash: clients see their connections drop)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        """Stop the server and delete its temp dir."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _log_tail(self) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-600:].strip() or "(empty log)"
        except OSError:
            return "(no log)"

    def __enter__(self) -> "RedisServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_redis_server(port: int | None = None, *, attempts: int = 3) -> RedisServer:
    """Start a private server; a free port picked here can be taken before redis binds it, so retry."""
    last: RedisUnavailableError | None = None
    for _ in range(attempts if port is None else 1):
        server = RedisServer(port)
        try:
            return server.start()
        except RedisUnavailableError as exc:
            server.stop()
            last = exc
    assert last is not None, "start_redis_server: no attempt was made"
    raise last


def ensure_redis(url: str | None = None) -> tuple[str, RedisServer | None]:
    """Return ``(url, server_or_None)`` for a Redis that answers.

    If Redis answers at ``url`` (default ``REDIS_URL``) it is returned with ``None``.  If not, and
    the address is local, a private server is started and returned; the caller stops it with
    ``server.stop()``.  A remote address that does not answer is an error: we never start a
    server on behalf of a remote host.
    """
    url = url or redis_url_from_env()
    _check_url(url)
    if ping(url):
        return url, None
    parts = urlsplit(url)
    if parts.scheme != "redis" or parts.hostname not in LOCAL_HOSTS:
        raise RedisUnavailableError(
            f"no Redis answers at {redact_url(url)}; start one there or set REDIS_URL to a running Redis"
        )
    server = start_redis_server()
    return server.url, server


def main() -> None:
    url, server = ensure_redis()
    print(url, flush=True)
    if server is None:
        return
    print(f"started a private redis-server (pid {server.proc.pid}); Ctrl-C stops it", file=sys.stderr)
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()


if __name__ == "__main__":
    main()
