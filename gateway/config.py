"""The gateway's configuration: one typed object built from flags and ``PDSERVE_*`` variables.

Every flag ``--some-flag`` also reads ``PDSERVE_SOME_FLAG`` (an empty variable means unset, as
compose files often write them).  A few older names stay as aliases because deployments set them:
``PDSERVE_GATEWAY_HOST``/``PDSERVE_GATEWAY_PORT`` (the compose files) and ``REDIS_URL``.
Precedence: the flag, then ``PDSERVE_<FLAG>``, then an alias, then the default.

Secrets (the admin token, the API key, the Redis password) are read from the environment or a
file and never printed (``common.cluster.secret_sources``); each must be strong, no two equal.  A
gateway that other machines can reach refuses to start without an API key unless
``--allow-no-api-key`` (an authenticating proxy in front of it) says so.
"""
from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field
from typing import Mapping

from common.engine.structured.backend import BACKENDS, DEFAULT_BACKEND
from common.engine.structured.compiler import DEFAULT_COMPILE_TIMEOUT_S
from gateway.prompts import DEFAULT_TEMPLATE_TIMEOUT_S
from gateway.tool_parsers import DEFAULT_PARSER, PARSERS
from common.cluster.auth import SECRET_ENV, AuthError, ClusterAuth, configure_auth, is_loopback, read_secret
from common.cluster.http_limits import DEFAULTS as HTTP_DEFAULTS, HELP as HTTP_HELP, HttpLimits, add_http_flags
from common.cluster.flags import EnvFlags, FlagParser, RecordsCommandLine, given_on_command_line, secret_value
from common.cluster.redis_util import (
    DEFAULT_REDIS_URL, redact_url, redis_url_with_password_file, warn_password_on_command_line,
)
from common.cluster.redis_keys import DEFAULT_KEY_PREFIX
from common.cluster.secret_sources import check_distinct, check_secret
from gateway.backpressure import WaitQueue
from gateway.response_store import (
    DEFAULT_CONVERSATION_TTL_S, DEFAULT_MAX_BYTES_PER_KEY, DEFAULT_MAX_PER_KEY, DEFAULT_TTL_S, MAX_TTL_S,
)
from gateway.routing import POLICIES, RoutingConfig
from gateway.tenants import CACHE_ISOLATION, ApiKeys, default_key_share, key_id, read_api_keys

log = logging.getLogger("pdserve.config")

# flag dest -> older variable names still honoured
ENV_ALIASES: dict[str, tuple[str, ...]] = {
    "host": ("PDSERVE_GATEWAY_HOST",),
    "port": ("PDSERVE_GATEWAY_PORT",),
    "redis_url": ("REDIS_URL",),
}


@dataclass(frozen=True)
class UpstreamTimeouts:
    """Bounds on every wait for a worker (seconds).

    ``connect``: TCP connect.  ``response``: the decode worker's answer (status and headers) to
    ``/generate`` -- it answers at once, with a stream or "busy"; a worker that accepts the
    connection and says nothing is benched.  ``first_token``: silence before the first frame
    (queueing and the remote prefill happen then).  ``idle``: silence between later frames.
    ``control``: the whole of a control call (abort, admin proxy).
    """

    connect: float = 5.0
    response: float = 30.0
    first_token: float = 300.0
    idle: float = 60.0
    control: float = 5.0

    def __post_init__(self) -> None:
        for name in ("connect", "response", "first_token", "idle", "control"):
            value = getattr(self, name)
            if not 0 < value <= 86400:
                raise ValueError(f"invalid config: upstream {name} timeout must be in (0, 86400] s, got {value}")


@dataclass(frozen=True)
class GatewayConfig:
    """The gateway's settings; see ``python -m gateway --help`` for what each one does."""

    model: str = "default"
    model_id: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    redis_url: str = field(default=DEFAULT_REDIS_URL, repr=False)  # may hold the Redis password
    key_prefix: str = DEFAULT_KEY_PREFIX
    routing_policy: str = RoutingConfig.policy
    skip_prefill_below_tokens: int = RoutingConfig.skip_prefill_below_tokens
    api_key: str | None = field(default=None, repr=False)
    api_keys_file: str | None = None
    max_inflight_per_key: int | None = None  # keys without their own limit; 0: none (default: tenants.py)
    cache_isolation: str = "none"  # "per-key": API keys never share prefix-cache blocks (gateway/tenants.py)
    # Serve without an API key on an address other machines reach (an authenticating proxy in front).
    allow_no_api_key: bool = False
    admin_token: str | None = field(default=None, repr=False)
    max_inflight: int = 512  # accepted requests at once; beyond: 429
    # The HTTP port's limits (common/cluster/http_limits.py, where their defaults live): http_limits().
    max_connections: int = HTTP_DEFAULTS.max_connections
    header_timeout: float = HTTP_DEFAULTS.header_timeout
    keepalive_timeout: float = HTTP_DEFAULTS.keepalive_timeout
    max_body_bytes: int = 4 << 20
    max_model_len: int | None = None
    chat_template: str | None = None  # a Jinja template, or a file holding one (see gateway/chat_template.py)
    # PDSERVE_CLUSTER_SECRET (or --cluster-secret-file): signs every call to a worker and verifies
    # the registry's entries; required unless the gateway listens on loopback only.  Never printed.
    cluster_secret: str | None = field(default=None, repr=False)
    timeouts: UpstreamTimeouts = field(default_factory=UpstreamTimeouts)
    bench_time: float = 5.0  # a worker that failed or timed out stays out of routing this long
    migration_limit: int = 3  # times one stream may move to another decode worker (gateway.migration); 0: never
    queue_size: int = 256  # requests held while no decode worker has room; beyond: 503
    queue_timeout: float = 10.0  # how long one is held; then 503 + Retry-After
    queue_size_per_key: int | None = None  # places one API key may hold; 0: no limit (default: tenants.py)
    client_read_timeout: float = HTTP_DEFAULTS.body_timeout  # a request body must arrive within this; then 408
    client_write_timeout: float = HTTP_DEFAULTS.write_timeout  # a client that takes no bytes this long is cut off
    prefix_lookup_timeout: float = 0.5  # the most one Redis prefix lookup may cost a request
    # The Responses API's stored responses (gateway/response_store.py): how long one is kept (0: none
    # stored), how many and how many bytes an API key keeps (its oldest go first), each Redis call's bound;
    # how long a conversation (gateway/conversation_store.py: in the same bounds) is kept after its last change.
    responses_store_ttl: float = DEFAULT_TTL_S
    conversations_ttl: float = DEFAULT_CONVERSATION_TTL_S
    responses_store_max: int = DEFAULT_MAX_PER_KEY
    responses_store_max_bytes: int = DEFAULT_MAX_BYTES_PER_KEY
    responses_store_timeout: float = 2.0
    redis_retry_interval: float = 2.0  # while Redis fails, prefix lookups skip it and probe this often
    inline_tokenize_chars: int = 4096  # longer inputs are tokenized in a thread, off the event loop
    tokenizer_threads: int = 2
    # Structured output: the backend that checks a request's grammar before dispatch (the workers'
    # --structured-output-backend), and how long that may take.
    structured_output_backend: str = DEFAULT_BACKEND
    grammar_compile_timeout: float = DEFAULT_COMPILE_TIMEOUT_S
    tool_call_parser: str = DEFAULT_PARSER  # how tool calls are read from an answer (tool_choice auto)
    chat_template_timeout: float = DEFAULT_TEMPLATE_TIMEOUT_S  # a render that takes longer is a 400
    # The API keys, read once by __post_init__: the keys checked are the keys served (api_keys()).
    _api_keys: ApiKeys = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        def bad(what: str) -> ValueError:
            return ValueError(f"invalid config: {what}")

        if self.routing_policy not in POLICIES:
            raise bad(f"routing_policy must be one of {', '.join(POLICIES)}, got {self.routing_policy!r}")
        for name in ("max_inflight", "max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise bad(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.skip_prefill_below_tokens < 0:
            raise bad(f"skip_prefill_below_tokens must be >= 0, got {self.skip_prefill_below_tokens}")
        for name in ("bench_time", "queue_timeout", "client_read_timeout", "client_write_timeout",
                     "prefix_lookup_timeout", "redis_retry_interval", "header_timeout", "keepalive_timeout",
                     "responses_store_timeout"):
            if not getattr(self, name) > 0:
                raise bad(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("queue_size", "inline_tokenize_chars", "max_inflight_per_key", "queue_size_per_key",
                     "migration_limit"):
            if (getattr(self, name) or 0) < 0:
                raise bad(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.tokenizer_threads < 1:
            raise bad(f"tokenizer_threads must be >= 1, got {self.tokenizer_threads}")
        if self.responses_store_max < 1 or self.responses_store_max_bytes < 1:
            raise bad(f"responses_store_max and responses_store_max_bytes must be >= 1, got "
                      f"{self.responses_store_max}, {self.responses_store_max_bytes}")
        if not 0 <= self.responses_store_ttl <= MAX_TTL_S:  # (NaN fails too)
            raise bad(f"responses_store_ttl must be in [0, {MAX_TTL_S:g}] s, got {self.responses_store_ttl}")
        if not 0 < self.conversations_ttl <= MAX_TTL_S:
            raise bad(f"conversations_ttl must be in (0, {MAX_TTL_S:g}] s, got {self.conversations_ttl}")
        if self.structured_output_backend not in BACKENDS:
            raise bad(f"structured_output_backend must be one of {', '.join(BACKENDS)}, got "
                      f"{self.structured_output_backend!r}")
        if self.tool_call_parser not in PARSERS:
            raise bad(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if not self.chat_template_timeout > 0:
            raise bad(f"chat_template_timeout must be > 0, got {self.chat_template_timeout}")
        if not self.grammar_compile_timeout > 0:
            raise bad(f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}")
        if not 0 <= self.port <= 65535:
            raise bad(f"port must be in 0..65535, got {self.port}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise bad(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.cache_isolation not in CACHE_ISOLATION:
            raise bad(f"cache_isolation must be one of {', '.join(CACHE_ISOLATION)}, got {self.cache_isolation!r}")
        self.auth()
        try:
            keys = read_api_keys(self.api_key, self.api_keys_file)
        except ValueError as exc:
            raise bad(str(exc)) from None
        self._check_secrets(list(keys))
        object.__setattr__(self, "_api_keys", ApiKeys(keys, default_key_share(self.max_inflight_per_key,
                                                                              self.max_inflight, len(keys))))
        if not self._api_keys.enabled and self.cache_isolation == "per-key":
            raise bad("cache_isolation per-key needs API keys (--api-key or --api-keys-file): without them "
                      "every caller is the same tenant")
        if self.open_to_the_network and not self.allow_no_api_key:
            raise bad(f"the gateway listens on {self.host}, which other machines can reach, but requires no API key: "
                      f"anyone who reaches it can use the model. Set PDSERVE_API_KEY (or --api-keys-file), bind "
                      f"--host 127.0.0.1, or set PDSERVE_ALLOW_NO_API_KEY=1 (--allow-no-api-key) when an "
                      f"authenticating proxy stands in front of it")

    @property
    def open_to_the_network(self) -> bool:
        """Other machines can reach the gateway and it asks them for no API key."""
        return not is_loopback(self.host) and not self.api_keys().enabled

    def _check_secrets(self, keys: list[str]) -> None:
        """The admin token and every API key (``keys``) are strong, and no two secrets are equal."""
        try:
            check_secret(self.admin_token, "the admin token (PDSERVE_ADMIN_TOKEN)")
            for key in keys:
                check_secret(key, f"API key {key_id(key)}")
            check_distinct({"the cluster secret": self.cluster_secret, "the admin token": self.admin_token,
                            **{f"API key {key_id(key)}": key for key in keys}})
        except ValueError as exc:
            raise ValueError(f"invalid config: {exc}") from None

    def api_keys(self) -> ApiKeys:
        """The API keys the gateway accepts, as read (once) and checked when the config was made."""
        return self._api_keys

    def wait_queue(self) -> WaitQueue:
        """The queue requests wait in while no decode worker has room (gateway/backpressure.py)."""
        return WaitQueue(self.queue_size, self.queue_timeout,
                         per_key=default_key_share(self.queue_size_per_key, self.queue_size, self._api_keys.count))

    def http_limits(self) -> HttpLimits:
        """What the gateway's HTTP port lets a client hold (``common.cluster.http_listener``)."""
        return HttpLimits(max_connections=self.max_connections, header_timeout=self.header_timeout,
                          keepalive_timeout=self.keepalive_timeout, body_timeout=self.client_read_timeout,
                          write_timeout=self.client_write_timeout)

    def auth(self) -> ClusterAuth:
        """The cluster auth the gateway signs with; raises ValueError naming the problem."""
        try:
            return configure_auth(self.cluster_secret, [self.host], "the gateway")
        except AuthError as exc:
            raise ValueError(f"invalid config: {exc}") from None


def env_names(parser: argparse.ArgumentParser | None = None) -> set[str]:
    """Every environment variable the gateway's flags read (for checks of deployment files)."""
    parser = parser or build_parser({})
    names = {SECRET_ENV}  # read directly, never a flag: a secret does not belong on a command line
    for action in parser._actions:
        if action.dest != "help":
            names.add(f"PDSERVE_{action.dest.upper()}")
            names.update(ENV_ALIASES.get(action.dest, ()))
    return names


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    p = FlagParser(
        description="pdserve gateway: OpenAI-compatible API in front of the pools. "
                    "Every flag also reads PDSERVE_<FLAG> (e.g. PDSERVE_MAX_INFLIGHT).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    flags = EnvFlags(p, env, ENV_ALIASES)  # secrets: --help shows where they come from, never their value
    add = flags.add

    add("--model", GatewayConfig.model, help="checkpoint (for the tokenizer and the chat template)")
    add("--model-id", help="served model name (as the workers use)")
    add("--host", GatewayConfig.host, help="bind address")
    add("--port", GatewayConfig.port, int)
    add("--redis-url", DEFAULT_REDIS_URL, show=redact_url, action=RecordsCommandLine,
        help="Redis (a password in it is never shown; better: --redis-password-file)")
    add("--redis-password-file", help="file holding the Redis password (spliced into --redis-url)")
    add("--key-prefix", GatewayConfig.key_prefix)
    add("--routing-policy", RoutingConfig.policy, choices=POLICIES)
    add("--skip-prefill-below", RoutingConfig.skip_prefill_below_tokens, int, help="prompts with fewer uncached tokens than this skip the prefill pool")
    flags.add_secret("--api-key", "the API key", help="require 'Authorization: Bearer KEY' (a file of keys: "
                                                      "--api-keys-file)", file_flag=False)
    add("--api-keys-file", help="accept the keys in this file: one per line, optionally 'key:limit' (that "
                                "key's limit on requests in flight); '#' starts a comment line")
    add("--max-inflight-per-key", GatewayConfig.max_inflight_per_key, int, help="requests in flight per API key without its own limit; "
                                                 "beyond: 429 (default: half of --max-inflight when several keys are "
                                                 "configured, none for a single key; 0: none)")
    add("--cache-isolation", GatewayConfig.cache_isolation, choices=CACHE_ISOLATION,
        help="prefix-cache sharing between API keys: 'none' (requests without a cache_salt share cached prompt "
             "blocks across keys; a cache_salt, bound to its API key, shares only with the same key's) or "
             "'per-key' (the gateway salts every request by its API key: keys never share blocks, and "
             "cached_tokens reveals nothing about other keys' prompts)")
    flags.add_switch("--allow-no-api-key", help="serve without an API key on an address other machines reach (only "
                                                "behind an authenticating proxy; logged as a warning)")
    flags.add_secret("--admin-token", "the admin token", help="enables /admin with this token")
    add("--cluster-secret-file", help="file holding the cluster secret (default: PDSERVE_CLUSTER_SECRET); "
                                      "required unless --host is a loopback address")
    add("--max-inflight", GatewayConfig.max_inflight, int, help="requests accepted at once; beyond: 429")
    add_http_flags(add, names=("max_connections", "header_timeout", "keepalive_timeout"))
    add("--max-body-bytes", GatewayConfig.max_body_bytes, int, help="request body limit; beyond: 413")
    add("--max-model-len", GatewayConfig.max_model_len, int)
    add("--chat-template", help="chat template for /v1/chat/completions: a file, or the Jinja template itself "
                                "(default: the checkpoint's; for Gemma checkpoints without one, Gemma's turn format)")
    add("--upstream-connect-timeout", UpstreamTimeouts.connect, float, help="seconds to connect to a worker")
    add("--upstream-response-timeout", UpstreamTimeouts.response, float, help="seconds for a decode worker to answer /generate "
                                                        "(a worker that does not is benched)")
    add("--first-token-timeout", UpstreamTimeouts.first_token, float, help="seconds of silence from the decode worker before the first "
                                                    "token (covers queueing and the remote prefill)")
    add("--upstream-idle-timeout", UpstreamTimeouts.idle, float, help="seconds of silence between tokens from the decode worker")
    add("--control-timeout", UpstreamTimeouts.control, float, help="seconds for a control call to a worker (abort, admin)")
    add("--bench-time", GatewayConfig.bench_time, float, help="seconds a worker that failed or timed out is kept out of routing")
    add("--migration-limit", GatewayConfig.migration_limit, int,
        help="times one stream may move to another decode worker when its worker dies, stops answering or drains "
             "(the prompt and the tokens sent so far are replayed there; 0: never: a lost worker ends its streams "
             "with an error, a draining one decodes them to the end)")
    add("--queue-size", GatewayConfig.queue_size, int, help="requests held while every decode worker is busy; "
                                                            "beyond: 503")
    add("--queue-timeout", GatewayConfig.queue_timeout, float, help="seconds a request is held for a busy decode "
                                                                    "pool; then 503")
    add("--queue-size-per-key", GatewayConfig.queue_size_per_key, int, help="places in the wait queue one API key may hold; beyond: 429 "
                                               "(default: half of --queue-size when several keys are configured, "
                                               "none for a single key; 0: none)")
    add("--client-read-timeout", HTTP_DEFAULTS.body_timeout, float, help=HTTP_HELP["body_timeout"])
    add("--client-write-timeout", HTTP_DEFAULTS.write_timeout, float,
        help=HTTP_HELP["write_timeout"] + "; a stream cut off frees its slot and KV blocks")
    add("--prefix-lookup-timeout", GatewayConfig.prefix_lookup_timeout, float, help="seconds one Redis prefix lookup may take (then: route by "
                                                    "load)")
    add("--redis-retry-interval", GatewayConfig.redis_retry_interval, float,
        help="after a failed prefix lookup, lookups skip Redis and probe it this often until it answers; after a "
             "failed call of the response store, it skips Redis this long")
    add("--responses-store-ttl", GatewayConfig.responses_store_ttl, float,
        help="seconds a Responses API response is kept for previous_response_id and GET /v1/responses/{id} "
             "(in Redis; 0: none stored)")
    add("--conversations-ttl", GatewayConfig.conversations_ttl, float,
        help="seconds a conversation (/v1/conversations) is kept after its last change (in Redis, in its API key's "
             "--responses-store-max and --responses-store-max-bytes beside its stored responses)")
    add("--responses-store-max", GatewayConfig.responses_store_max, int,
        help="stored responses one API key keeps; storing one more forgets its oldest")
    add("--responses-store-max-bytes", GatewayConfig.responses_store_max_bytes, int,
        help="bytes of stored responses one API key keeps in Redis (its oldest go first); one response's "
             "conversation over this or --max-body-bytes is not stored")
    add("--responses-store-timeout", GatewayConfig.responses_store_timeout, float,
        help="seconds one Redis call of the response store may take (a read then fails with 503; a write is skipped)")
    add("--inline-tokenize-chars", GatewayConfig.inline_tokenize_chars, int, help="longer inputs are tokenized in a thread, off the event loop")
    add("--tokenizer-threads", GatewayConfig.tokenizer_threads, int, help="threads for tokenizing long inputs and applying chat templates")
    add("--structured-output-backend", GatewayConfig.structured_output_backend, choices=BACKENDS,
        help="grammar backend that checks response_format, structured_outputs and tools before dispatch "
             "(the workers' own flag of the same name should agree)")
    add("--grammar-compile-timeout", GatewayConfig.grammar_compile_timeout, float,
        help="seconds a request's grammar may take to compile; then a 400")
    add("--chat-template-timeout", GatewayConfig.chat_template_timeout, float,
        help="seconds the chat template may take to render one request's messages (then a 400)")
    add("--tool-call-parser", GatewayConfig.tool_call_parser, choices=PARSERS,
        help="the format tool calls take in the model's answers (tool_choice auto): hermes (<tool_call> JSON, "
             "Qwen 2.5/3), llama3_json (Llama 3.x), json (a JSON call or list of calls, any template)")
    add("--log-level", "INFO")
    return p


def config_from_args(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> GatewayConfig:
    """The configuration ``args`` describe; logs a warning for each secret given on the command line
    and for a gateway that serves other machines without an API key (``--allow-no-api-key``)."""
    try:
        secret = read_secret(args.cluster_secret_file, env)
        api_key = secret_value(args, "api_key", "the API key")
        admin_token = secret_value(args, "admin_token", "the admin token")
        redis_url = redis_url_with_password_file(args.redis_url, args.redis_password_file)
    except (AuthError, ValueError) as exc:
        raise ValueError(f"invalid config: {exc}") from None
    warn_password_on_command_line(args.redis_url, given_on_command_line(args, "redis_url"))
    config = GatewayConfig(
        model=args.model, model_id=args.model_id, host=args.host, port=args.port, redis_url=redis_url,
        key_prefix=args.key_prefix, routing_policy=args.routing_policy,
        skip_prefill_below_tokens=args.skip_prefill_below, api_key=api_key, api_keys_file=args.api_keys_file,
        max_inflight_per_key=args.max_inflight_per_key, cache_isolation=args.cache_isolation,
        allow_no_api_key=bool(args.allow_no_api_key), admin_token=admin_token,
        max_connections=args.max_connections, client_write_timeout=args.client_write_timeout,
        header_timeout=args.header_timeout, keepalive_timeout=args.keepalive_timeout,
        max_inflight=args.max_inflight, max_body_bytes=args.max_body_bytes, max_model_len=args.max_model_len,
        chat_template=args.chat_template,
        cluster_secret=secret,
        timeouts=UpstreamTimeouts(connect=args.upstream_connect_timeout, response=args.upstream_response_timeout,
                                  first_token=args.first_token_timeout, idle=args.upstream_idle_timeout,
                                  control=args.control_timeout),
        bench_time=args.bench_time, migration_limit=args.migration_limit, queue_size=args.queue_size, queue_timeout=args.queue_timeout,
        queue_size_per_key=args.queue_size_per_key,
        client_read_timeout=args.client_read_timeout, inline_tokenize_chars=args.inline_tokenize_chars,
        prefix_lookup_timeout=args.prefix_lookup_timeout, redis_retry_interval=args.redis_retry_interval,
        responses_store_ttl=args.responses_store_ttl, conversations_ttl=args.conversations_ttl,
        responses_store_max=args.responses_store_max,
        responses_store_max_bytes=args.responses_store_max_bytes,
        responses_store_timeout=args.responses_store_timeout,
        tokenizer_threads=args.tokenizer_threads, structured_output_backend=args.structured_output_backend,
        grammar_compile_timeout=args.grammar_compile_timeout, tool_call_parser=args.tool_call_parser,
        chat_template_timeout=args.chat_template_timeout,
    )
    if config.open_to_the_network:
        log.warning("the gateway serves %s without an API key (PDSERVE_ALLOW_NO_API_KEY): anyone who reaches it can "
                    "use the model; only an authenticating proxy in front of it should", config.host)
    return config
