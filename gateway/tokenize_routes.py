"""``POST /tokenize`` and ``POST /detokenize``, shaped as vLLM's.

    /tokenize    {"model", "prompt", "add_special_tokens": true, "return_token_strs": false}
                 {"model", "messages", "add_generation_prompt": true, "continue_final_message"?,
                  "chat_template_kwargs"?, "tools"?, "return_token_strs"?}   (the chat template, as a chat
                                                                             request renders it)
                 -> {"count", "max_model_len", "tokens", "token_strs": the tokens' pieces where asked, else null}
    /detokenize  {"model", "tokens"} -> {"prompt"}

Behind the same API keys as ``/v1`` and within their admission (429 past a key's requests in
flight); bodies bounded like the generation endpoints' (a prompt too long for the model is a 400
before it is tokenized), token ids checked against the vocabulary; long inputs are tokenized and
decoded off the event loop.
"""
from __future__ import annotations

from typing import Annotated

import msgspec
from aiohttp import web

from common.engine.sampling_params import MAX_TOKEN_ID
from gateway.handlers import OpenAIHandlers
from gateway.openai_errors import from_msgspec
from gateway.openai_protocol import invalid, json_response, parse_chat_request

TOKENIZE_PATHS = ("/tokenize", "/detokenize")


class TokenizeText(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool | None = False


class Detokenize(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    tokens: Annotated[list[Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]], msgspec.Meta(max_length=1 << 20)]
    model: str | None = None


class TokenizeAnswer(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeAnswer(msgspec.Struct):
    prompt: str


def _decode(body: bytes, kind: type):
    try:
        return msgspec.json.decode(body, type=kind, strict=False)
    except msgspec.MsgspecError as exc:  # naming the field, as the OpenAI endpoints' refusals do
        raise from_msgspec(exc, body=body) from None
    except RecursionError:
        raise invalid("Request body is nested too deeply") from None


def add_tokenize_routes(app: web.Application, handlers: OpenAIHandlers) -> None:
    services = handlers.services

    def check_model(model: str | None) -> None:
        if model is not None:
            handlers._check_model(model)

    async def tokenize(request: web.Request) -> web.Response:
        body = await services.read_body(request)
        fields = _decode(body, dict[str, msgspec.Raw])
        pieces = False
        if "messages" in fields:  # the chat shape: the same checks as a chat request
            chat = fields
            chat.pop("add_special_tokens", None)
            pieces = _decode(chat.pop("return_token_strs", b"false"), bool | None)
            chat.setdefault("model", msgspec.json.encode(services.model_id))
            req = parse_chat_request(b"{" + b",".join(msgspec.json.encode(k) + b":" + bytes(v)
                                                       for k, v in chat.items()) + b"}")
            check_model(req.model)
            messages, render = handlers._chat_renderer(req, req.tool_plan())
            tokenized = lambda: services.prompts.chat(messages, render)  # noqa: E731
        else:
            req = _decode(body, TokenizeText)
            check_model(req.model)
            tokenized = lambda: services.prompts.text(req.prompt, req.add_special_tokens)  # noqa: E731 (bounded)
            pieces = req.return_token_strs
        async with services.admission(request["tenant"]):  # the tokenizer only once admitted, as a generation
            ids = await tokenized()  # (off the loop when long)
        strs = services.tokenizer.convert_ids_to_tokens(ids) if pieces else None  # (vLLM's: the pieces)
        return json_response(TokenizeAnswer(len(ids), services.max_model_len, ids, strs))

    async def detokenize(request: web.Request) -> web.Response:
        req = _decode(await services.read_body(request), Detokenize)
        check_model(req.model)
        if req.tokens and max(req.tokens) >= services.vocab_size:
            raise invalid(f"token id {max(req.tokens)} is outside the vocabulary [0, {services.vocab_size})", "tokens")
        async with services.admission(request["tenant"]):
            text = await services.prompts.detokenize(req.tokens)  # off the loop when long
        return json_response(DetokenizeAnswer(text))

    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
