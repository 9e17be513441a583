"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``, as a JSON response
or as an SSE event of a stream that has already started; a request body's decoding errors as 400s
naming the parameter (``from_msgspec``)."""
from __future__ import annotations

import re

import msgspec
from aiohttp import web

from common.cluster.http_listener import BODY_ENCODINGS

_DEFAULT_ERROR_TYPE = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    502: "upstream_error",
    503: "service_unavailable_error",
    504: "timeout_error",
}


class ErrorBody(msgspec.Struct):
    """The inside of OpenAI's error object: a human-readable ``message``, the error ``type``
    (``invalid_request_error``, ``rate_limit_error``, ...), the request parameter at fault
    (``param``, e.g. ``"messages[0].content"``; None when none is), and a machine-readable ``code``."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct):
    """OpenAI's error shape: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody


class OpenAIError(Exception):
    """A request failure with its HTTP status, in OpenAI's error shape.

    ``retry_after`` (seconds) becomes a ``Retry-After`` header; 429 and 503 always carry one.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _DEFAULT_ERROR_TYPE.get(status, "error")
        if retry_after is None and status in (429, 503):
            retry_after = 1
        self.retry_after = retry_after

    def body(self) -> ErrorResponse:
        return ErrorResponse(ErrorBody(self.message, self.type, self.param, self.code))

    def to_json(self) -> bytes:
        return _encode(self.body())

    def to_response(self, body: msgspec.Struct | None = None) -> web.Response:
        """The error as a JSON response (``body``: another API's shape of it; default OpenAI's)."""
        headers = {}
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        return web.Response(status=self.status, body=self.to_json() if body is None else _encode(body),
                            headers=headers, content_type="application/json")

    def to_sse(self) -> bytes:
        """The error as one SSE event, for a stream that has already started."""
        return b"data: " + self.to_json() + b"\n\n"


def invalid(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    """A 400 for a bad parameter."""
    return OpenAIError(400, message, param=param, code=code)


class Refused(ValueError):
    """A worker's "invalid" answer: the request's own fault, about ``param`` where it names one (its
    grammar could not be followed: code ``invalid_grammar``)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = "invalid_grammar" if param is not None else None


def as_invalid(exc: ValueError) -> OpenAIError:
    """The 400 a ``ValueError`` of the request's stands for (a worker's ``Refused`` names its field)."""
    return invalid(str(exc), getattr(exc, "param", None), getattr(exc, "code", None))


def required(value, at: str, field: str):
    """``value``, or a 400 naming ``at.field`` as missing where it is None (a field required by the
    kind of item or block it sits in)."""
    if value is None:
        raise invalid(f"Missing required parameter: '{at}.{field}'.", f"{at}.{field}", "missing_required_parameter")
    return value


def check_json_media(content_type: str | None) -> None:
    """A 415 unless a body's ``Content-Type`` is JSON (``application/json``, ``application/*+json``);
    None: the header is absent (refused too: check it only where there is a body).  Also what keeps
    a web page from posting to a gateway on its user's machine: a browser sends a body cross-site
    without asking first where it says it is a form or text, or says nothing (a ``Blob``)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        got = f"got {content_type[:100]!r}" if content_type is not None else "and the request has none"
        raise OpenAIError(415, f"Content-Type must be application/json, {got}", code="unsupported_media_type")


def check_body_encoding(encoding: str | None) -> None:
    """A 415 unless a body's ``Content-Encoding`` is one this server reads (an unknown one was read
    as if it were none, and ``br`` refused as a missing package)."""
    if encoding is not None and encoding.strip().lower() not in BODY_ENCODINGS + ("",):
        raise OpenAIError(415, f"Content-Encoding {encoding[:100]!r} is not supported: send the body as "
                          f"{', '.join(BODY_ENCODINGS)}", code="unsupported_content_encoding")


def check_model(model: str, served: str) -> None:
    """A 404 (OpenAI's ``model_not_found``) unless ``model`` is the one served."""
    if model != served:
        raise OpenAIError(404, f"The model '{model}' does not exist; this server serves '{served}'", param="model",
                          code="model_not_found")


def error_response(status: int, message: str, *, param: str | None = None, code: str | None = None,
                   type: str | None = None, retry_after: float | None = None) -> web.Response:
    """An aiohttp response in OpenAI's error shape (e.g. 401 bad key, 404 unknown model,
    413 body too large, 429/503 saturated with Retry-After)."""
    return OpenAIError(status, message, param=param, code=code, type=type,
                       retry_after=retry_after).to_response()


_ERROR_PATH_RE = re.compile(r" - at `\$\.?([^`]*)`$")


def split_error_path(text: str) -> tuple[str, str]:
    """A msgspec error message split into ``(detail, path)``: ``"Expected `int` - at `$.stop[0]`"``
    gives ``("Expected `int`", "stop[0]")``; a path into an array at the top is ``"[1]"``; no path: ``""``."""
    m = _ERROR_PATH_RE.search(text)
    return (text[: m.start()], m.group(1)) if m else (text, "")


_encode = msgspec.json.Encoder().encode


_UNKNOWN_RE = re.compile(r"^Object contains unknown field `([^`]*)`")
# vLLM's guided-decoding fields, removed there (its server now ignores them: unconstrained output);
# here they are refused like any unknown field, the refusal naming what replaced each.
_REPLACED_FIELDS = {f"guided_{key}": f"structured_outputs: {{\"{key}\": ...}}" for key in ("json", "regex", "choice",
                                                                                             "grammar")}
_MISSING_RE = re.compile(r"^Object missing required field `([^`]*)`")


# A high surrogate escape with no low one after it: msgspec calls such a body "truncated", or the
# next character the end of a hex escape.
_LONE_SURROGATE_RE = re.compile(rb"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2})(?!\\u[dD][c-fC-F])")


def from_msgspec(exc: msgspec.MsgspecError, at: str = "", body: bytes = b"") -> OpenAIError:
    """A msgspec error as a 400 naming the parameter; ``at``: where the decoded value sits in the
    request (``"messages[2]"``), its error path continues from there; ``body``: what was decoded
    (to say what is wrong with JSON that does not parse)."""
    text = str(exc)
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        said = ("truncated", "hex escape", "surrogate")  # what msgspec says of one (else the fault is elsewhere)
        if any(s in text for s in said) and (lone := _LONE_SURROGATE_RE.search(body)):
            text = (f"{lone.group(1).decode()} at byte {lone.start(1)} is a lone UTF-16 high surrogate (no low "
                    "surrogate \\udc00-\\udfff follows it): not a character")
        return invalid(f"Request body is not valid JSON: {text}")
    detail, path = split_error_path(text)
    if at:
        path = at + path if not path or path.startswith("[") else f"{at}.{path}"
    if u := _UNKNOWN_RE.match(detail):
        name = f"{path}.{u.group(1)}" if path else u.group(1)
        hint = f" (vLLM's guided_* fields are gone; send {_REPLACED_FIELDS[name]})" if name in _REPLACED_FIELDS else ""
        return invalid(f"Unrecognized request argument supplied: {name}{hint}", name, "unknown_parameter")
    if r := _MISSING_RE.match(detail):
        name = f"{path}.{r.group(1)}" if path else r.group(1)
        return invalid(f"Missing required parameter: '{name}'.", name, "missing_required_parameter")
    if not path:
        return invalid(f"Invalid request body: {detail}")
    return invalid(f"Invalid value for '{path}': {detail}", path, "invalid_value")
