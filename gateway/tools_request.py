"""A chat request's tools: ``tools``, ``tool_choice`` and ``parallel_tool_calls``, read within bounds,
and what they make of the request.

    tool_choice     the output                                   how
    none            text (the tools are still shown to the model through the template)
    auto            text, or tool calls in the template's format  parsed by --tool-call-parser
    required        a JSON array of {"name", "parameters"}        a grammar from the tools' schemas
                    objects, at least one (exactly one with
                    parallel_tool_calls false)
    {"type": "function", "function": {"name": N}}
                    the arguments of N: a JSON object             a grammar from N's parameters

``required`` and a named function are enforced (``ToolPlan.structured``), so the output always
parses; ``auto`` is read from the text after the fact.  Default: ``auto`` when tools are given,
``none`` otherwise (OpenAI's rule).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from common.engine.structured.spec import StructuredOutput
from gateway.openai_errors import invalid
from gateway.structured_request import grammar_json, schema_text

MAX_TOOLS = 128
FunctionName = Annotated[str, msgspec.Meta(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]


class FunctionDefinition(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: FunctionName


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """What the tools make of one request: ``mode`` is none | auto | required | named;
    ``function`` the named function; ``structured`` the grammar that enforces it (None: free text)."""

    tools: tuple[Tool, ...]
    mode: str
    function: str | None = None
    parallel: bool = True
    structured: StructuredOutput | None = None

    @property
    def parses_calls(self) -> bool:
        return self.mode != "none" and bool(self.tools)

    def argument_grammars(self, but: str | None = None) -> list[StructuredOutput]:
        """Each tool's arguments (but function ``but``'s) as the grammar a call forced to it compiles,
        each schema once."""
        grammars: dict[str, StructuredOutput] = {}
        for i, tool in enumerate(self.tools):
            text = schema_text(arguments_schema(tool.function.parameters), "tools")
            if tool.function.name != but and text not in grammars:
                grammars[text] = StructuredOutput("json_schema", text, f"tools[{i}]")
        return list(grammars.values())

    def template_tools(self) -> list[dict] | None:
        """The tools as chat templates take them (OpenAI's shape, as plain dicts; a field not sent --
        ``strict``, ``description`` -- is left out, not rendered as null)."""
        if not self.tools:
            return None
        return [{"type": t.type, "function": {key: value for key, value in msgspec.to_builtins(t.function).items()
                                              if value is not None}} for t in self.tools]


class FlatFunctionTool(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """A function tool as the Responses API sends it: the function's fields beside ``type``."""

    type: Literal["function"]
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def as_tool(self) -> Tool:
        return Tool(type="function", function=FunctionDefinition(name=self.name, description=self.description,
                                                                 parameters=self.parameters, strict=self.strict))


def read_tools(raw: msgspec.Raw, from_msgspec, flat: bool = False) -> tuple[Tool, ...]:
    """The body's ``tools`` (chat's shape; ``flat``: the Responses API's), bounded in size and number."""
    grammar_json(raw, "tools")
    shape = FlatFunctionTool if flat else Tool
    try:
        tools = msgspec.json.decode(raw, type=Annotated[list[shape], msgspec.Meta(max_length=MAX_TOOLS)], strict=False)
    except msgspec.MsgspecError as exc:
        raise from_msgspec(exc, "tools") from None
    if flat:
        tools = [t.as_tool() for t in tools]
    check_tools(tools, "tools[{}].parameters" if flat else "tools[{}].function.parameters")
    return tuple(tools)


def check_tools(tools, parameters_at: str) -> None:
    """A 400 (``invalid_tools``) where two of the tools name the same function, or one's parameters
    are a schema of something other than an object (``parameters_at``: where the i-th tool's schema
    is in the request, a format string) -- whatever tool_choice says, as OpenAI's API."""
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise invalid("tools: two functions have the same name", "tools", "invalid_tools")
    for i, tool in enumerate(tools):
        kind = (tool.function.parameters or {}).get("type", "object")
        if kind != "object" and not (isinstance(kind, list) and "object" in kind):
            at = parameters_at.format(i)
            raise invalid(f"{at}: a function's parameters are a JSON Schema of type 'object', got type {kind!r}",
                          at, "invalid_tools")


# A function sent without ``parameters`` takes none (OpenAI's API: "an empty parameter list"): its
# arguments are ``{}``, not any object a model may ramble into.
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
ANY_ARGUMENTS = {"type": "object"}  # ``"parameters": {}``: a schema with no constraint (still an object)


def arguments_schema(parameters: dict | None) -> dict:
    """The schema a call's arguments follow: none without ``parameters``, any object for ``{}``."""
    return NO_PARAMETERS if parameters is None else parameters or ANY_ARGUMENTS


def plan_tools(tools: tuple[Tool, ...], choice: ToolChoice | None, parallel: bool) -> ToolPlan:
    """The request's ``ToolPlan``; a 400 for a choice the tools cannot meet."""
    if choice is None:
        choice = "auto" if tools else "none"
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        match = next((t for t in tools if t.function.name == name), None)
        if match is None:
            raise invalid(f"tool_choice names function {name!r}, which is not among the tools", "tool_choice",
                          "invalid_tools")
        schema = arguments_schema(match.function.parameters)
        return ToolPlan(tools, "named", name, parallel,
                        StructuredOutput("json_schema", schema_text(schema, "tools"), "tools"))
    if choice in ("auto", "required") and not tools:
        raise invalid(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "required":
        return ToolPlan(tools, "required", None, parallel,
                        StructuredOutput("json_schema", schema_text(calls_schema(tools, parallel), "tools"), "tools"))
    return ToolPlan(tools, choice, None, parallel)


def calls_schema(tools: tuple[Tool, ...], parallel: bool) -> dict:
    """The JSON schema of ``required``'s output: ``[{"name": ..., "parameters": {...}}, ...]``."""
    items = [{"type": "object",
              "properties": {"name": {"const": t.function.name},
                             "parameters": arguments_schema(t.function.parameters)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": items[0] if len(items) == 1 else {"anyOf": items},
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema
