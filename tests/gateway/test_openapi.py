"""The gateway's OpenAPI description (``GET /openapi.json``), and schemathesis against it: a real
gateway and tiny-model prefill and decode workers must answer every generated request -- valid by the
schema or not -- without a 5xx, with a documented status, content type and body shape (JSON, and
each SSE event's payload); a request valid by the schema must be served (our checks in
tests/support/openapi_checks.py), so the document says what the gateway really accepts.

The run is bounded (a fixed number of examples per operation, a fixed seed) to stay well under a
minute on two cores.  A wider run against a running gateway, by hand::

    SCHEMATHESIS_HOOKS=tests.support.openapi_checks python -m schemathesis.cli run http://GATEWAY/openapi.json \
        --phases coverage,fuzzing --max-examples 200 -H "Authorization: Bearer KEY" \
        --checks all --exclude-checks positive_data_acceptance,negative_data_rejection,ignored_auth
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.support.checkpoints import VOCAB
from tests.support.cluster import extra_gateway, http_json

pytestmark = pytest.mark.slow(seconds=23)  # a long file: scheduled by its length (tests/conftest.py)

API_KEY = "sk-openapi-test-0123456789"
MAX_EXAMPLES = 12  # per operation (a GET without parameters needs one)
CHECKS = ("not_a_server_error,status_code_conformance,content_type_conformance,response_schema_conformance,"
          "valid_requests_are_served,generation_is_reached")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stack(small_stack):
    """A gateway with an API key and a short context (so generation stays quick) on the shared
    small stack's pools."""
    with extra_gateway(small_stack, "openapi", ["--api-key", API_KEY, "--max-model-len", "128"]) as proc:
        yield SimpleNamespace(gateway_url=proc.url, model_name=small_stack.model_name, procs=small_stack.procs)


@pytest.fixture(scope="module")
def document(stack) -> dict:
    with urllib.request.urlopen(f"{stack.gateway_url}/openapi.json", timeout=10) as resp:
        assert resp.headers["Content-Type"].startswith("application/json")
        return json.load(resp)


def test_the_document_describes_what_the_gateway_validates(stack, document):
    assert document["openapi"].startswith("3.1")
    assert set(document["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/responses",
                                      "/v1/responses/input_tokens",
                                      "/v1/responses/{response_id}", "/v1/responses/{response_id}/input_items",
                                      "/v1/responses/{response_id}/cancel", "/v1/conversations",
                                      "/v1/conversations/{conversation_id}",
                                      "/v1/conversations/{conversation_id}/items",
                                      "/v1/conversations/{conversation_id}/items/{item_id}",
                                      "/v1/messages", "/v1/messages/count_tokens", "/v1/models", "/v1/models/{model}",
                                      "/health", "/metrics", "/openapi.json"}
    assert set(document["paths"]["/v1/responses/{response_id}"]) == {"get", "delete"}
    schemas = document["components"]["schemas"]
    completion = schemas["CompletionRequest"]
    assert set(completion["required"]) == {"model", "prompt"} and completion["additionalProperties"] is False
    assert completion["properties"]["model"]["enum"] == [stack.model_name]
    assert (completion["properties"]["n"]["minimum"], completion["properties"]["n"]["maximum"]) == (1, 16)
    temperature = completion["properties"]["temperature"]["anyOf"][0]
    assert (temperature["minimum"], temperature["maximum"]) == (0.0, 2.0)
    chat = schemas["ChatCompletionRequest"]
    assert set(chat["required"]) == {"model", "messages"}
    assert schemas["ChatMessage"]["required"] == ["content", "role"]
    assert document["components"]["securitySchemes"]["apiKey"]["scheme"] == "bearer"
    token_ids = completion["properties"]["prompt"]["anyOf"][1]["items"]
    assert (token_ids["minimum"], token_ids["maximum"]) == (0, VOCAB - 1)
    # Rules between fields are stated too (stream_options needs stream; top_logprobs needs logprobs;
    # a tool choice needs tools; a tool message needs its call's id).
    assert {rule["if"]["required"][0] for rule in chat["allOf"]} == {"stream_options", "top_logprobs", "max_tokens",
                                                                      "tool_choice"}
    assert {rule["if"]["required"][0] for rule in schemas["ChatMessage"]["allOf"]} == {
        "role", "tool_calls", "tool_call_id", "refusal", "annotations"}
    # The grammar-bearing fields are described in their wire shapes.
    assert set(schemas["ResponseFormat"]["properties"]["type"]["enum"]) == {"text", "json_object", "json_schema"}
    assert "StructuredOutput" not in schemas and schemas["StructuredOutputsParams"]["maxProperties"] == 1
    assert chat["properties"]["logit_bias"]["anyOf"][0]["maxProperties"] == 300
    responses = schemas["ResponsesRequest"]
    assert set(responses["required"]) == {"model", "input"} and responses["additionalProperties"] is False
    assert responses["properties"]["store"]["default"] is True  # stored unless it says otherwise
    assert responses["properties"]["previous_response_id"]["anyOf"][0]["pattern"] == "^resp_[0-9a-f]{32}$"
    item_kinds = {kind["properties"]["type"]["const"] for kind in responses["properties"]["input"]["anyOf"][1]["items"]["anyOf"]}
    assert item_kinds == {"message", "function_call", "function_call_output", "reasoning"}
    assert {rule["if"]["required"][0] for rule in responses["allOf"]} == {"top_logprobs", "tool_choice",
                                                                          "structured_outputs", "background"}
    assert responses["properties"]["background"]["type"] == "boolean"  # (const false where nothing is stored)
    assert "cancelled" in schemas["ResponseObject"]["properties"]["status"]["enum"]
    assert set(document["paths"]["/v1/conversations/{conversation_id}"]) == {"get", "post", "delete"}
    added = schemas["ConversationItemsCreate"]["properties"]["items"]
    assert added["maxItems"] == 20 and "reasoning" not in json.dumps(added)
    messages = schemas["MessagesRequest"]  # Anthropic's: each role's blocks, max_tokens required but in count_tokens
    assert set(messages["required"]) == {"model", "messages", "max_tokens"}
    assert set(schemas["MessagesCountTokensRequest"]["required"]) == {"model", "messages"}
    turns = {turn["properties"]["role"]["const"]: {block["properties"]["type"].get("const") or "thinking"
                                                   for block in turn["properties"]["content"]["anyOf"][1]["items"]["anyOf"]}
             for turn in messages["properties"]["messages"]["items"]["anyOf"]}
    assert turns == {"user": {"text", "tool_result"}, "assistant": {"text", "tool_use", "thinking"}}
    error = document["paths"]["/v1/messages"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert error["$ref"].endswith("/ErrorEvent")


def test_generated_requests_never_get_a_server_error(stack, tmp_path):
    """Fuzzing only, positive and negative data (the coverage phase's boundary cases of every field
    are hundreds of generations: run it by hand, as the module docstring shows).  A fixed seed keeps the run the same
    from one run to the next.  Afterwards every process still runs and serves."""
    cmd = [sys.executable, "-m", "schemathesis.cli", "run", f"{stack.gateway_url}/openapi.json",
           "--phases", "fuzzing", "--mode", "all", "--max-examples", str(MAX_EXAMPLES), "--seed", "20261130",
           "--checks", CHECKS, "--workers", "1", "--request-timeout", "60", "--generation-database", "none",
           "--header", f"Authorization: Bearer {API_KEY}", "--no-color", "--suppress-health-check", "all"]
    env = dict(os.environ, SCHEMATHESIS_HOOKS="tests.support.openapi_checks",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, f"schemathesis found problems:\n{run.stdout[-20000:]}\n{run.stderr[-5000:]}"
    selected = re.search(r"Operations: +(\d+) selected", run.stdout)
    tested = re.search(r"Tested: (\d+)", run.stdout)
    cases = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
    # Every operation of the document ran (schemathesis may leave out the document's own path).
    assert selected and tested and int(selected.group(1)) >= 5 and tested.group(1) == selected.group(1), run.stdout
    assert cases and cases.group(1) == cases.group(2) and int(cases.group(1)) > 2 * MAX_EXAMPLES, run.stdout
    assert all(proc.alive for proc in stack.procs.values()), "a process of the stack crashed"
    assert http_json(f"{stack.gateway_url}/health")["pools"]["decode"]["healthy"] == 1


@pytest.mark.parametrize("method,path,allowed", [("DELETE", "/v1/completions", "POST"),
                                                 ("TRACE", "/health", "GET"), ("POST", "/v1/models", "GET")])
def test_a_method_the_path_does_not_take_is_405_naming_the_allowed_ones(stack, method, path, allowed):
    req = urllib.request.Request(f"{stack.gateway_url}{path}", method=method,
                                 headers={"Authorization": f"Bearer {API_KEY}"})
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(req, timeout=10)
    assert caught.value.code == 405
    assert allowed in caught.value.headers["Allow"]
    assert json.load(caught.value)["error"]["type"] == "invalid_request_error"
