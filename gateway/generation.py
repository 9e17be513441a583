"""One sequence of an accepted request on its way through the gateway (``n`` of them for ``n > 1``)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Collection

from common.cluster.messages import TokenFrame
from common.engine.sampling_params import SamplingParams
from gateway.dispatch import DispatchResult
from gateway.sampling_options import SamplingOptions
from gateway.tool_output import ToolOutput


@dataclass
class Generation:
    """``request_id`` names it to the workers; ``response_id`` is the client's id (shared by the
    choices of one request -- ``n`` a prompt, of one prompt or a batch -- each with its ``index``).
    ``first_choice``: choice 0 of its prompt (the prompt's tokens count once in the usage)."""

    request_id: str
    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    options: SamplingOptions
    params: SamplingParams
    cache_salt: str | None = None  # as served (gateway/tenants.py: the client's, or per API key)
    key_id: str | None = None  # its API key (Tenant.key_id): its share of the wait queue
    index: int = 0
    first_choice: bool = True
    response_id: str = ""
    cluster_request: str = ""  # the request's id in the cluster, its choices' alike (not the client's: unique)
    echo: str = ""  # completions with echo: the prompt's text, before the answer
    echo_only: bool = False  # max_tokens=0 with echo: the prompt alone is answered (the token generated is not)
    arrival: float = field(default_factory=time.monotonic)
    created: int = field(default_factory=lambda: int(time.time()))  # its request's, in every chunk (``_serve``)
    pieces: list[str] = field(default_factory=list)  # the text, as streamed (joined once at the end)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    prompt_logprobs: list | None = None  # echo with logprobs: entry i scores prompt token i + 1
    opened: bool = False  # its stream's opening chunks (a chat's role, an echo) are out
    streamed_chars: int = 0  # a completion's stream: where the next chunk's text offsets begin (0: not yet known)
    cached_tokens: int = 0
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # the stop string, or the stop_token_ids token, that ended it
    tools: ToolOutput | None = None  # a chat request whose answer may hold tool calls
    running: list[int] = field(default_factory=lambda: [1])  # its prompt's choices not ended (one list for them all)
    ended: bool = False  # counted out of ``running`` (its run ended, or it never started)
    dispatch: DispatchResult = field(default_factory=DispatchResult)  # where it ran

    def __post_init__(self) -> None:
        self.response_id = self.response_id or self.request_id
        self.cluster_request = self.cluster_request or self.request_id  # (unset: a request of its own)

    def ending_token(self, frame: TokenFrame, special_ids: Collection[int]) -> int | None:
        """The token that ended the answer in ``frame`` -- one of its stop tokens (``stop_token_ids``,
        the chat format's end of turn) or a special one (EOS) -- if one did.  As in vLLM, its text is
        not the answer's unless ``include_stop_str_in_output``, and one of ``stop_token_ids`` is the
        choice's ``stop_reason``."""
        ids = frame.token_ids
        if not (frame.finished and frame.finish_reason == "stop" and ids):
            return None
        stops = self.params.stop_token_ids if self.params is not None else self.options.stop_token_ids
        return ids[-1] if ids[-1] in stops or ids[-1] in special_ids else None

    @property
    def text(self) -> str:
        return "".join(self.pieces)

    @property
    def output_finish_reason(self) -> str | None:
        """``tool_calls`` for an answer that ended in tool calls of its choosing, else the engine's
        (``ToolOutput.finish_reason``)."""
        return self.finish_reason if self.tools is None else self.tools.finish_reason(
            self.tools.made_calls, self.finish_reason, self.stop_reason)
