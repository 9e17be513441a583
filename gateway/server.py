"""The gateway process: the OpenAI HTTP API in front of the prefill and decode pools.

    GET  /v1/models, /v1/models/{model}, /health, /metrics, /openapi.json; vLLM's /ping, /version, /load
                                                         (the public API described: gateway/openapi.py)
    POST /v1/completions, /v1/chat/completions,
         /v1/responses, /v1/messages,
         /v1/messages/count_tokens                       (Authorization: Bearer <api key>, or x-api-key, if set)
    GET, DELETE /v1/responses/{id}, GET /v1/responses/{id}/input_items   (stored responses; the same keys)
    POST /v1/responses/input_tokens                      (a response's prompt tokens, counted)
    GET  /admin/pools                                    (X-Admin-Token)
    GET  /admin/metrics                                  (X-Admin-Token; the per-API-key metrics)
    POST /admin/workers/{worker_id}/drain                (proxied to the worker)
    POST /admin/workers/{worker_id}/role  {"role": ...}  (proxied to the worker)
    GET  /admin/workers/{worker_id}/steps?since=&limit=  (proxied: the engine's recent steps)
"""
from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import signal
from urllib.parse import urlencode

import aiohttp
import msgspec
from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError
from yarl import URL

from common.engine.structured.compiler import GrammarCompiler, make_backend
from common.cluster.aio import run_service
from common.cluster.credentials import credential_bytes, presented
from common.cluster.messages import read_response
from common.engine.model_config import load_model_config
from common.engine.loading.checkpoint_path import resolve_checkpoint
from common.engine.loading.tokenizer import load_tokenizer
from common.cluster.prefix_index import PrefixIndexReader
from common.cluster.redis_util import connect
from common.cluster.registry import ROLES, WorkerRegistry
from gateway.admission import InflightBound
from gateway.probe_routes import add_probe_routes
from gateway.background_responses import BackgroundResponses, default_max_runs
from gateway.chat_template import resolve_chat_format
from common.cluster.http_listener import GuardedSite
from gateway.config import GatewayConfig, build_parser, config_from_args
from gateway.dispatch import Dispatcher
from gateway.handlers import HandlerServices, OpenAIHandlers
from gateway.metrics import GatewayMetrics
from gateway.openapi import openapi_document
from gateway.openai_errors import as_invalid, check_body_encoding, check_json_media, check_model
from gateway.request_extensions import REQUEST_ID_HEADER, is_request_id
from gateway.messages_output import error_body
from gateway.openai_protocol import ModelCard, ModelList, OpenAIError, json_response, now
from gateway.pool import WorkerPool
from gateway.prompts import PromptEncoder
from gateway.redis_probe import RedisProbe
from gateway.conversation_routes import add_conversation_routes
from gateway.conversation_store import ConversationStore
from gateway.response_store import ResponseStore
from gateway.stored_responses import add_stored_response_routes
from gateway.routing import Router, RoutingConfig
from gateway.tokenize_routes import TOKENIZE_PATHS, add_tokenize_routes
from gateway.tool_parsers import make_parser

log = logging.getLogger(__name__)

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages")
MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # Anthropic's API: its error shape


def _error_response(request: web.Request, error: OpenAIError) -> web.Response:
    """``error`` in OpenAI's shape, or on Anthropic's Messages API in that API's."""
    return error.to_response(error_body(error) if request.path in MESSAGES_PATHS else None)


class Gateway:
    """Holds everything a request needs; ``start``/``stop`` bracket its life."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.auth = config.auth()
        checkpoint = resolve_checkpoint(config.model)
        model = load_model_config(checkpoint)
        self.model_id = config.model_id or checkpoint.name
        self.max_model_len = min(config.max_model_len or model.max_model_len, model.max_model_len)
        self.vocab_size = model.vocab_size
        self.tokenizer = load_tokenizer(checkpoint)
        self.chat_format = resolve_chat_format(self.tokenizer, model.model_type, config.chat_template)
        if self.chat_format.template is not None:
            self.tokenizer.chat_template = self.chat_format.template
        log.info("chat template: %s", self.chat_format.source)
        self.grammars = GrammarCompiler(
            functools.partial(make_backend, config.structured_output_backend, self.tokenizer, self.vocab_size),
            timeout_s=config.grammar_compile_timeout)
        self.prompts = PromptEncoder(self.tokenizer, self.max_model_len, inline_chars=config.inline_tokenize_chars,
                                     template_timeout_s=config.chat_template_timeout,
                                     threads=config.tokenizer_threads)
        self.metrics = GatewayMetrics()
        self.api_keys = config.api_keys()
        # Requests generating (background responses among them); calls on stored responses, and streams of
        # background responses, apart: a key whose requests hold its limit can still poll and cancel them.
        self.admission = InflightBound(config.max_inflight, "requests", on_refused=self.metrics.key_refused,
                                       on_change=self.metrics.requests_in_flight.inc)
        self.store_admission = InflightBound(config.max_inflight, "calls on stored responses")
        self.stream_admission = InflightBound(config.max_inflight, "streams of background responses")
        self.openapi = msgspec.json.encode(openapi_document(self.model_id, vocab_size=self.vocab_size,
                                                             stored_responses=config.responses_store_ttl > 0,
                                                             api_keys=self.api_keys.enabled))
        self.redis = None
        self.session: aiohttp.ClientSession | None = None  # token streams from decode workers
        self.control_session: aiohttp.ClientSession | None = None  # aborts, admin calls
        self.pool: WorkerPool | None = None
        self.prefix_index: PrefixIndexReader | None = None
        self.redis_probe: RedisProbe | None = None
        self.dispatcher: Dispatcher | None = None
        self.response_store: ResponseStore | None = None
        self.conversations: ConversationStore | None = None
        self.background: BackgroundResponses | None = None  # (where responses are stored)

    async def start(self) -> None:
        if unavailable := await self.grammars.prepare():  # before it serves (GrammarCompiler.prepare)
            log.warning("structured output is unavailable: %s", unavailable)
        self.redis = connect(self.config.redis_url)
        registry = WorkerRegistry(self.redis, key_prefix=self.config.key_prefix, auth=self.auth,
                                  on_rejected=lambda reason: self.metrics.registry_rejected.labels(reason).inc())
        self.pool = WorkerPool(registry, self.model_id, bench_s=self.config.bench_time,
                               on_redis_error=self.metrics.redis_unavailable.inc)
        await self.pool.start()
        self.prefix_index = prefix_index = PrefixIndexReader(
            self.redis, key_prefix=self.config.key_prefix, timeout_s=self.config.prefix_lookup_timeout,
            retry_interval_s=self.config.redis_retry_interval, on_unavailable=self.metrics.redis_unavailable.inc)
        self.redis_probe = RedisProbe(self.redis, timeout_s=self.config.prefix_lookup_timeout,
                                      interval_s=self.config.redis_retry_interval)
        if self.config.responses_store_ttl > 0:
            self.response_store = ResponseStore(
                self.redis, key_prefix=self.config.key_prefix, ttl_s=self.config.responses_store_ttl,
                conversation_ttl_s=self.config.conversations_ttl,
                max_per_key=self.config.responses_store_max, max_bytes_per_key=self.config.responses_store_max_bytes,
                max_bytes=self.config.max_body_bytes, timeout_s=self.config.responses_store_timeout,
                retry_s=self.config.redis_retry_interval, on_failure=self.metrics.responses_store_failures.inc)
            self.background = BackgroundResponses(self.response_store, default_max_runs(self.config.max_inflight))
            self.conversations = ConversationStore(self.response_store)
        self.session, self.control_session = self._client_sessions()
        router = Router(RoutingConfig(policy=self.config.routing_policy,
                                      skip_prefill_below_tokens=self.config.skip_prefill_below_tokens))
        self.dispatcher = Dispatcher(self.pool, router, prefix_index, self.session, self.control_session,
                                     self.metrics, self.model_id, timeouts=self.config.timeouts, auth=self.auth,
                                     queue=self.config.wait_queue(), migration_limit=self.config.migration_limit)

    def _client_sessions(self) -> tuple[aiohttp.ClientSession, aiohttp.ClientSession]:
        """One pool for streams, one for control calls.  Streams are bounded by admission alone (an
        admitted request holds up to ``MAX_REQUEST_CHOICES`` of them, a drain's pre-copies more): a
        pool bound under that made a stream wait for a connection inside its response timeout, and
        that wait benched a healthy worker.  Control calls (aborts) queue for one of ``max_inflight``
        connections within their total timeout.  Streams have no total timeout (a long answer is
        fine); the dispatcher bounds every wait for a frame, and no socket read outlasts the longest
        of those bounds."""
        t, n = self.config.timeouts, self.config.max_inflight

        def session(limit: int, timeout: aiohttp.ClientTimeout) -> aiohttp.ClientSession:
            return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit, limit_per_host=limit),
                                         timeout=timeout)

        # The dispatcher's bounds come first; the socket read bound is only a backstop under them.
        backstop = max(t.response, t.first_token, t.idle)
        return (session(0, aiohttp.ClientTimeout(total=None, sock_connect=t.connect, sock_read=backstop)),
                session(n, aiohttp.ClientTimeout(total=t.control, sock_connect=t.connect)))

    async def stop(self) -> None:
        if self.background:
            await self.background.close()
        await self.dispatcher.drain()
        if self.pool:
            await self.pool.stop()
        for session in (self.session, self.control_session):
            if session:
                await session.close()
        if self.redis_probe:
            await self.redis_probe.close()
        if self.redis:
            await self.redis.aclose()
        self.prompts.close()

    # ---- helpers used by the handlers ------------------------------------------------------

    async def read_body(self, request: web.Request) -> bytes:
        """The whole body: refused (413) as soon as it is known to exceed the limit -- from its
        declared length, or while it is read -- and bounded in time (408) for slow senders; a body
        that is not JSON by its Content-Type is refused (415, ``check_json_media``; none and no body: b""), as is one in an encoding it cannot read."""
        content_type = request.headers.get("Content-Type")
        if content_type is not None:
            check_json_media(content_type)
        check_body_encoding(request.headers.get("Content-Encoding"))
        if request.content_length is not None and request.content_length > self.config.max_body_bytes:
            raise self._too_large(request, declared=True)
        try:
            async with asyncio.timeout(self.config.client_read_timeout):
                body = await request.read()  # aiohttp stops at client_max_size (HTTPRequestEntityTooLarge)
        except TimeoutError:
            raise OpenAIError(408, f"the request body did not arrive within {self.config.client_read_timeout:g} s",
                              code="request_timeout") from None
        except RequestPayloadError as exc:  # malformed gzip/deflate or chunks, or a body cut short
            why = getattr(exc.__cause__, "message", "") or "malformed"
            raise OpenAIError(400, f"the request body could not be read: {why}", code="invalid_request_body") from None
        if body and content_type is None:
            check_json_media(None)
        return body

    def _too_large(self, request: web.Request, declared: bool = False) -> OpenAIError:
        """``declared``: refused by its declared length, before any of it was read; else once past the
        limit while read -- a compressed body by what it inflates to, not by its own length."""
        if declared:
            what = f"of {request.content_length} bytes"
        elif request.headers.get("Content-Encoding", "identity").lower() != "identity":
            what = "(decompressed)"
        else:
            what = "sent in chunks" if request.content_length is None else f"of {request.content_length} bytes"
        return OpenAIError(413, f"Request body {what} exceeds the limit of {self.config.max_body_bytes} bytes",
                           code="request_too_large")

    # ---- app -------------------------------------------------------------------------------

    def handler_services(self) -> HandlerServices:
        """What the OpenAI handlers use of this gateway (once ``start`` has built the dispatcher)."""
        return HandlerServices(
            config=self.config, model_id=self.model_id, max_model_len=self.max_model_len, vocab_size=self.vocab_size,
            tokenizer=self.tokenizer, chat_format=self.chat_format, prompts=self.prompts, dispatcher=self.dispatcher,
            metrics=self.metrics, read_body=self.read_body, admission=self.admission, grammars=self.grammars,
            tool_parser=make_parser(self.config.tool_call_parser), response_store=self.response_store,
            background=self.background, conversations=self.conversations)

    def app(self) -> web.Application:
        """The HTTP application (after ``start``)."""
        handlers = OpenAIHandlers(self.handler_services())
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=self.config.max_body_bytes)
        app.on_response_prepare.append(_echo_request_id)
        app.router.add_post("/v1/completions", handlers.completions)
        app.router.add_post("/v1/chat/completions", handlers.chat_completions)
        app.router.add_post("/v1/responses", handlers.responses)
        app.router.add_post("/v1/responses/input_tokens", handlers.count_response_tokens)
        add_stored_response_routes(app, self.response_store, self.store_admission, self.stream_admission,
                                   self.background, self.config.client_write_timeout)
        add_conversation_routes(app, self.conversations, self.store_admission, self.read_body)
        app.router.add_post("/v1/messages", handlers.messages)
        app.router.add_post("/v1/messages/count_tokens", handlers.count_message_tokens)
        app.router.add_get("/v1/models", self._models)
        app.router.add_get("/v1/models/{model:.+}", self._model)  # an id may hold slashes ("org/name")
        add_tokenize_routes(app, handlers)
        app.router.add_get("/health", self._health)
        add_probe_routes(app, self._health, self.admission)  # vLLM's /ping, /version, /load
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/openapi.json", self._openapi)
        app.router.add_get("/admin/pools", self._admin_pools)
        app.router.add_get("/admin/metrics", self._admin_metrics)
        app.router.add_post("/admin/workers/{worker_id}/drain", self._admin_proxy("drain"))
        app.router.add_post("/admin/workers/{worker_id}/role", self._admin_proxy("role"))
        app.router.add_get("/admin/workers/{worker_id}/steps", self._admin_proxy("steps"))
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler):
        """OpenAI-shaped errors for everything, and the request count by outcome for /v1 calls
        (the HTTP status, or what a started stream ended with)."""
        outcome = "500"
        try:
            response = await handler(request)
            outcome = request.get("outcome", str(response.status))
            return response
        except OpenAIError as exc:
            outcome = str(exc.status)
            return _error_response(request, exc)
        except web.HTTPException as exc:
            outcome = str(exc.status)
            if exc.status == 413:
                return _error_response(request, self._too_large(request))
            if exc.status in (404, 405):
                response = _error_response(request, OpenAIError(exc.status, f"{request.method} {request.path}: "
                                                                            f"{exc.reason}"))
                if "Allow" in exc.headers:  # a 405 says which methods the path takes (RFC 9110)
                    response.headers["Allow"] = exc.headers["Allow"]
                return response
            raise
        except ValueError as exc:
            outcome = "400"
            return _error_response(request, as_invalid(exc))
        except (asyncio.CancelledError, ConnectionResetError):
            outcome = "client_disconnected"
            raise
        finally:
            if request.path in GENERATION_PATHS:
                self.metrics.requests.labels(self.model_id, request.path, outcome).inc()

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path.startswith("/v1/") or request.path in TOKENIZE_PATHS:
            # Anthropic's clients send the key as x-api-key
            key = presented(request.headers, "x-api-key")
            tenant = self.api_keys.authenticate(presented(request.headers, "Authorization")
                                                or (f"Bearer {key}" if key else ""))
            if tenant is None:
                raise OpenAIError(401, "Incorrect API key provided", code="invalid_api_key")
            request["tenant"] = tenant
        return await handler(request)

    async def _models(self, _request: web.Request) -> web.Response:
        return json_response(ModelList([self._model_card()]))

    async def _model(self, request: web.Request) -> web.Response:
        """OpenAI's ``GET /v1/models/{model}``: the served model's card, else 404."""
        check_model(request.match_info["model"], self.model_id)
        return json_response(self._model_card())

    def _model_card(self) -> ModelCard:
        return ModelCard(self.model_id, now(), max_model_len=self.max_model_len)

    async def _openapi(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.openapi, content_type="application/json")

    async def _health(self, _request: web.Request) -> web.Response:
        """Healthy workers per pool.  503 when no decode-capable worker is healthy (nothing can
        generate); an empty prefill pool is "degraded" (decode workers compute prompts themselves).
        ``workers`` counts the active registry entries by role (what ``pdctl`` and the launcher read);
        ``pools`` the workers routing would use now (active and not benched after a failure)."""
        active = [w for w in self.pool.workers if w.state == "active"]
        routable = {w.worker_id for w in self.pool.routable()}
        pools = {}
        for pool, roles in (("decode", ("decode", "both")), ("prefill", ("prefill", "both"))):
            members = [w for w in active if w.role in roles]
            healthy = sum(1 for w in members if w.worker_id in routable)
            pools[pool] = {"healthy": healthy, "benched": len(members) - healthy}
        problems = []
        if not pools["decode"]["healthy"]:
            problems.append("no healthy decode worker: generation requests wait for one, then get 503")
        if not pools["prefill"]["healthy"]:
            problems.append("no healthy prefill worker: decode workers compute prompts themselves "
                            "(serving goes on, with slower time to first token)")
        # Redis as the registry refresh saw it (twice a second) and, when a prefix lookup failed
        # last (it stays so until the next lookup, which an idle gateway never makes), as a
        # bounded PING finds it now (gateway/redis_probe.py).
        redis_ok = self.pool.redis_ok and (self.prefix_index.available or await self.redis_probe.answers())
        if not redis_ok:
            problems.append("Redis does not answer: routing goes on by the workers last read, without the prefix "
                            "index; stored responses and conversations answer 503")
        status = "unavailable" if not pools["decode"]["healthy"] else "degraded" if problems else "ok"
        return web.json_response({
            "status": status, "model": self.model_id,
            "redis": redis_ok,
            "workers": {role: sum(1 for w in active if w.role == role) for role in ROLES},
            "pools": pools, "problems": problems,
        }, status=503 if status == "unavailable" else 200)

    async def _metrics(self, _request: web.Request) -> web.Response:
        """The public metrics: nothing in them names an API key."""
        self.metrics.observe_workers(self.pool.workers)
        body, content_type = self.metrics.render()
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def _admin_metrics(self, request: web.Request) -> web.Response:
        """The metrics per API key (``key_id`` labels), for the admin only."""
        self._check_admin(request)
        body, content_type = self.metrics.render_per_key()
        return web.Response(body=body, headers={"Content-Type": content_type})

    def _check_admin(self, request: web.Request) -> None:
        token = self.config.admin_token
        if not token:
            raise OpenAIError(403, "the admin API is disabled (start the gateway with an admin token: "
                                   "PDSERVE_ADMIN_TOKEN_FILE or PDSERVE_ADMIN_TOKEN, which make up passes on too)")
        if not hmac.compare_digest(credential_bytes(presented(request.headers, "X-Admin-Token") or ""),
                                   credential_bytes(token)):
            raise OpenAIError(401, "missing or wrong admin token", code="invalid_admin_token")

    async def _admin_pools(self, request: web.Request) -> web.Response:
        self._check_admin(request)
        await self.pool.refresh()
        return web.Response(body=msgspec.json.encode({"model": self.model_id, "workers": self.pool.workers}),
                            content_type="application/json")

    def _admin_proxy(self, action: str):
        """A worker admin call, signed with the cluster secret: POST drain and role (the pool is
        re-read after a change), GET steps (its query string passed on, the answer bounded)."""
        method = "GET" if action == "steps" else "POST"
        answer_limit = (2 << 20) if action == "steps" else (64 << 10)

        async def proxy(request: web.Request) -> web.Response:
            self._check_admin(request)
            worker_id = request.match_info["worker_id"]
            await self.pool.refresh()
            worker = next((w for w in self.pool.workers if w.worker_id == worker_id), None)
            if worker is None:
                raise OpenAIError(404, f"unknown worker {worker_id!r}", code="worker_not_found")
            body = b"{}" if method == "POST" else b""
            if action == "role":
                body = await request.read()
                _check_role_body(body)
            path = f"/admin/{action}"
            query = {key: request.query[key] for key in ("since", "limit") if key in request.query}
            if query:  # re-encoded here, so the signature covers exactly what is sent
                path += "?" + urlencode(query)
            # The operator's admin token stays here: the worker trusts the signature, made for it alone.
            headers = {"Content-Type": "application/json",
                       **self.auth.sign_request(method, path, body, audience=worker.audience)}
            try:
                async with self.control_session.request(method, URL(f"{worker.http_address}{path}", encoded=True),
                                                        data=body or None, headers=headers) as resp:
                    status, answered = resp.status, await read_response(resp, answer_limit)
            except asyncio.TimeoutError:  # (aiohttp's own timeouts are TimeoutErrors too)
                # It may yet act on the call (a worker stopped, then resumed): the operator is told so.
                late = " (the call may still take effect when it does: its state in `pdctl status` tells)"
                raise OpenAIError(504, f"worker {worker_id} did not answer within {self.config.timeouts.control:g} s"
                                  + (late if method == "POST" else "")) from None
            except (aiohttp.ClientError, ValueError) as exc:
                raise OpenAIError(503, f"worker {worker_id} did not answer: {type(exc).__name__}: {exc}") from None
            if status >= 400:  # the worker's refusal, in this API's error shape; the operator's own 4xx only
                ours = status >= 500 or status in (401, 403)  # (a signature refused: this gateway's setup)
                raise OpenAIError(502 if ours else status, f"worker {worker_id} answered {status}: "
                                  f"{_worker_error(answered)}")
            answer = web.Response(status=status, body=answered, content_type="application/json")
            if status == 200 and method == "POST":
                await self.pool.refresh()  # the worker re-registered already: route by its new state now
            return answer

        return proxy


async def _echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """The client's ``X-Request-Id`` (where it is one an answer's id may be) back on the answer."""
    named = request.headers.get(REQUEST_ID_HEADER)
    if named is not None and is_request_id(named):
        response.headers[REQUEST_ID_HEADER] = named


def _worker_error(body: bytes) -> str:
    """A worker's error answer's message (``{"error": "..."}``), or its first 200 characters."""
    try:
        error = msgspec.json.decode(body)["error"]
    except (msgspec.DecodeError, KeyError, TypeError, RecursionError):
        error = None
    return error if isinstance(error, str) else body[:200].decode(errors="replace")


def _check_role_body(body: bytes) -> None:
    """Refuse a bad ``{"role": ...}`` here, before anything reaches the worker."""
    try:
        role = msgspec.json.decode(body)["role"]
    except (msgspec.DecodeError, KeyError, TypeError, RecursionError):  # RecursionError: nested too deep
        choices = "|".join(ROLES)
        raise OpenAIError(400, f'expected a JSON body {{"role": "{choices}"}}', param="role") from None
    if role not in ROLES:
        raise OpenAIError(400, f"unknown role {role!r}; expected one of {', '.join(ROLES)}", param="role",
                          code="invalid_role")


async def serve(config: GatewayConfig) -> None:
    try:
        gateway = Gateway(config)
    except ValueError as exc:  # a checkpoint or chat template that cannot serve
        raise SystemExit(f"error: {exc}") from None
    await gateway.start()
    runner = web.AppRunner(gateway.app(), handler_cancellation=True, access_log=None)
    await runner.setup()
    site = GuardedSite(runner, config.host, config.port, config.http_limits(),
                       on_refused=gateway.metrics.connections_refused.inc,
                       on_write_timeout=gateway.metrics.client_write_timeouts.inc)
    await site.start()  # stopped by runner.cleanup()
    port = site.port
    print(f"gateway serving {gateway.model_id} at http://{config.host}:{port}", flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        if gateway.background:
            gateway.background.stopping()  # (its streams end: the listener need not wait for them)
        await runner.cleanup()
        await gateway.stop()


def main() -> None:
    try:
        args = build_parser().parse_args()
    except ValueError as exc:  # a PDSERVE_* variable that is not valid
        raise SystemExit(f"error: {exc}") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"error: {exc}") from None
    run_service(serve(config))
