"""Schemathesis checks of our own (loaded with SCHEMATHESIS_HOOKS=tests.support.openapi_checks by
tests/gateway/test_openapi.py): the OpenAPI document must describe what the gateway accepts.

``valid_requests_are_served``: a request valid by the schema is served, unless it asks for more
tokens than the context holds -- a limit that depends on the prompt's length in tokens, which no
schema can state --, names a stored response, conversation, item or a model that is not there (a
404, or a 400 for the ``previous_response_id`` a request continues and the item a page starts
after), or the gateway is saturated (429/503, a legitimate
answer to any request).
``generation_is_reached``: each generation endpoint served at least one request during the run,
so the fuzzing reached the engine and not only the validation in front of it.
``map_body``: a response's ``conversation`` given as a well-formed id names one that is not there (the
fuzzing made it up: a 404), so it is left out of the body -- the fuzzing reaches generation as often
as before; ill-formed ones stay (they test the validation).
"""
from __future__ import annotations

import re

import schemathesis

GENERATION = ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses", "POST /v1/messages")


_CONVERSATION_ID = re.compile(r"conv_[0-9a-f]{32}")


@schemathesis.hook
def map_body(context, body):
    if context.operation is None or not isinstance(body, dict):
        return body
    if not context.operation.path.startswith("/v1/responses"):
        return body
    named = body.get("conversation")
    named = named.get("id") if isinstance(named, dict) else named
    if isinstance(named, str) and _CONVERSATION_ID.fullmatch(named):
        body = {field: value for field, value in body.items() if field != "conversation"}
    return body


def _error_code(response) -> str | None:
    try:
        return response.json()["error"].get("code")  # (the Messages API's errors carry it beside their type)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


@schemathesis.check
def valid_requests_are_served(ctx, response, case):
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or response.status_code < 400:
        return None
    if response.status_code in (429, 503):
        return None
    if response.status_code == 404 and case.operation.path.startswith(("/v1/responses/{response_id}",
                                                                        "/v1/conversations/{conversation_id}",
                                                                        "/v1/models/{model}")):
        return None  # a stored response, conversation or item by that id, a model by that name: whether there is
        # one, no schema says
    if response.status_code == 404 and _error_code(response) == "conversation_not_found":
        return None  # (the conversation a response names)
    # What no schema can say: the prompt's length in tokens; whether a grammar compiles; whether
    # the tools' names are unique and hold the one tool_choice names; a batch's prompts times n;
    # prompt_logprobs without stream (a rule the chat schema cannot carry besides its others);
    # continue_final_message on a last message of tool calls (the last item of a list); and a
    # function_call_output whose call_id no call before it made.
    if response.status_code == 400 and _error_code(response) in ("context_length_exceeded", "invalid_grammar",
                                                                 "invalid_tools", "too_many_choices",
                                                                 "prompt_logprobs_not_streamed",
                                                                 "last_message_not_continuable",
                                                                 "previous_response_not_found", "item_not_found",
                                                                 "prefill_not_constrainable",
                                                                 "function_call_not_found"):
        return None
    raise AssertionError(f"a request valid by the OpenAPI document was refused with {response.status_code}: "
                         f"{response.text[:500]}")


@schemathesis.check
class generation_is_reached:  # noqa: N801 (the check's name, as schemathesis reports it)
    """Each generation endpoint answered 200 at least once."""

    def __init__(self):
        self.served: set[str] = set()

    def after_response(self, ctx, response, case):
        if response.status_code == 200:
            self.served.add(case.operation.label)

    def after_run(self, ctx):
        missing = [label for label in GENERATION if label not in self.served]
        if missing:
            raise AssertionError(f"no generated request was served by {', '.join(missing)}")
