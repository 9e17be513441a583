"""The OpenAI answers of one request's generations: stream chunks and whole responses.

A request has a generation per choice (``n`` a prompt, one prompt or a batch); every chunk names its
choice's ``index``, the usage counts each prompt once and the completions of all of them.
"""
from __future__ import annotations

import functools
from typing import Any, Protocol, Sequence

import msgspec

from common.cluster.messages import TokenFrame
from gateway.generation import Generation
from gateway.openai_errors import OpenAIError
from gateway.openai_protocol import (
    SSE_DONE, ChatChoice, ChatCompletionChunk, ChatCompletionResponse, ChatDelta, ChatLogprobs, ChatResponseMessage,
    ChatStreamChoice, ChatTokenLogprob, CompletionChoice, CompletionChunk, CompletionLogprobs, CompletionResponse,
    TopLogprob, Usage, sse_event,
)
from gateway.openai_responses import PromptLogprob, PromptLogprobs, ScoredChatCompletionResponse, ScoredCompletionChoice
from gateway.token_bytes import token_bytes


TOKEN_TEXTS = 1 << 16  # token texts a gateway remembers
MIN_LOGPROB = -9999.0  # a token the request's rules forbid (-inf) is shown with this, as vLLM does: JSON has no -inf


def shown(logprob: float) -> float:
    """A logprob as an answer gives it: a number, never -inf or NaN (null to JSON, which clients refuse)."""
    return logprob if logprob >= MIN_LOGPROB else MIN_LOGPROB


def usage(gens: Sequence[Generation], this_choice: bool = False) -> Usage:
    """A request's usage: each prompt counted once (by its first choice), every choice's output;
    ``this_choice``: ``gens`` is one choice, its prompt counted whichever choice it is."""
    cached = sum(g.cached_tokens for g in gens if g.first_choice or this_choice)
    return Usage.of(prompt_tokens(gens, this_choice), sum(len(g.token_ids) for g in gens), cached)


def prompt_tokens(gens: Sequence[Generation], this_choice: bool = False) -> int:
    """The request's prompt tokens: each prompt's once (``this_choice``: see ``usage``)."""
    return sum(len(g.prompt_ids) for g in gens if g.first_choice or this_choice)


class ResponseShapes:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        # A token's text, remembered: an answer's logprobs name up to ~131k tokens (a scored prompt's
        # alternatives), mostly the same few thousand, each decoded on the event loop.
        self._token_text = functools.lru_cache(maxsize=TOKEN_TEXTS)(self._decode_token)
        self._token_bytes = functools.lru_cache(maxsize=TOKEN_TEXTS)(self._bytes_of)

    def _decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def _bytes_of(self, token_id: int) -> list[int]:
        return token_bytes(self.tokenizer, token_id, self._token_text(token_id))

    def completion_logprobs(self, entries, offset: int, alternatives: int | None = None) -> CompletionLogprobs | None:
        """``entries``' logprobs in the completions' shape, text offsets from ``offset``; at most
        ``alternatives`` a token (None: all it has), and the chosen token's own -- OpenAI's legacy
        API and vLLM always show it: up to ``logprobs`` + 1 entries, the chosen one first."""
        if not entries:
            return None
        tokens = [self._token_text(e.token_id) for e in entries]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[shown(e.logprob) for e in entries],
            top_logprobs=[{tokens[i]: shown(e.logprob), **{self._token_text(t): shown(lp) for t, lp in e.top[:alternatives]}}
                          for i, e in enumerate(entries)],
            text_offset=offsets,
        )

    def echo_logprobs(self, gen: Generation) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs (echo with logprobs; ``None`` without): its first token has
        none, nothing precedes it; offsets count each token's text, a BOS token's "<bos>" too, which
        the echo does not hold (as vLLM's do)."""
        alternatives = gen.options.logprobs
        if not gen.echo or alternatives is None or gen.prompt_logprobs is None:
            return None
        first = self._token_text(gen.prompt_ids[0])
        opening = CompletionLogprobs(tokens=[first], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
        return _joined(opening, self.completion_logprobs(gen.prompt_logprobs, len(first), alternatives))

    def _answer_offset(self, gen: Generation) -> int:
        """Where the answer's text offsets begin: after the echoed prompt's tokens (or its text)."""
        echoed = self.echo_logprobs(gen)
        return echoed.text_offset[-1] + len(echoed.tokens[-1]) if echoed else len(gen.echo)

    def prompt_logprobs(self, gen: Generation) -> PromptLogprobs | None:
        """vLLM's ``prompt_logprobs`` (asked for by that extension; ``None`` without): entry i maps
        prompt token i and its top alternatives to their logprobs, ranks and texts."""
        alternatives = gen.options.prompt_logprobs
        if alternatives is None or gen.prompt_logprobs is None:
            return None
        scored: PromptLogprobs = [None]
        for e in gen.prompt_logprobs:
            entry = {str(t): PromptLogprob(shown(lp), rank, self._token_text(t))
                     for rank, (t, lp) in enumerate(e.top[:alternatives], start=1)}
            entry.setdefault(str(e.token_id), PromptLogprob(shown(e.logprob), e.rank, self._token_text(e.token_id)))
            scored.append(entry)
        return scored

    def chat_logprobs(self, entries) -> ChatLogprobs | None:
        if not entries:
            return None
        out = []
        for e in entries:
            top = [TopLogprob(self._token_text(t), shown(lp), self._token_bytes(t)) for t, lp in e.top]
            out.append(ChatTokenLogprob(self._token_text(e.token_id), shown(e.logprob), self._token_bytes(e.token_id),
                                        top))
        return ChatLogprobs(content=out)

    # ---- streamed ------------------------------------------------------------------------------

    def first_chunks(self, gen: Generation, usage_so_far: Usage | None = None) -> list:
        """What a choice's stream opens with: a chat's role (and empty content, but for an answer
        that can only be calls: none, as the whole answer's); a completion's echoed prompt (with
        ``usage_so_far`` where every chunk carries it)."""
        if gen.kind == "chat":
            calls_only = gen.tools is not None and gen.tools.plan.mode in ("required", "named")
            return [ChatCompletionChunk(gen.response_id, gen.created, gen.model, [ChatStreamChoice(
                gen.index, ChatDelta(role="assistant", content=None if calls_only else ""))], usage_so_far)]
        if gen.echo:
            return [CompletionChunk(gen.response_id, gen.created, gen.model,
                                    [CompletionChoice(gen.index, gen.echo, self.echo_logprobs(gen))], usage_so_far)]
        return []

    def chunks(self, gen: Generation, delta: str, frame: TokenFrame, final: bool, usage_so_far: Usage | None) -> list:
        """A frame's chunks; ``final``: the last frame so far (the finish reason goes on it)."""
        ending = final and gen.finish_reason is not None
        if gen.tools is not None:
            return self._tool_chunks(gen, delta, frame, ending, usage_so_far)
        if gen.echo_only:  # the prompt alone (its chunk opened the stream): the token generated is not shown
            delta, frame = "", TokenFrame()
        # A chunk a token, as vLLM's: a token that completes no text yet (a character spelled in bytes,
        # a stop string's possible start) sends an empty one, so tools that time chunks time tokens.
        if not (delta or frame.token_ids or frame.logprobs or ending):
            return []
        finish, stop = (gen.output_finish_reason, gen.stop_reason) if final else (None, None)
        if gen.kind == "chat":
            choice = ChatStreamChoice(gen.index, ChatDelta(content=delta) if delta or frame.token_ids else ChatDelta(),
                                      self.chat_logprobs(frame.logprobs), finish, stop)
            return [ChatCompletionChunk(gen.response_id, gen.created, gen.model, [choice], usage_so_far)]
        if not gen.streamed_chars:  # (the answer's first chunk: its offsets begin after the echo)
            gen.streamed_chars = self._answer_offset(gen)
        logprobs = self.completion_logprobs(frame.logprobs, gen.streamed_chars)
        gen.streamed_chars += len(delta)
        choice = CompletionChoice(gen.index, delta, logprobs, finish, stop)
        return [CompletionChunk(gen.response_id, gen.created, gen.model, [choice], usage_so_far)]

    def _tool_chunks(self, gen: Generation, delta: str, frame: TokenFrame, ending: bool, usage_so_far) -> list:
        """A chat frame's chunks when the answer may hold tool calls (gateway/tool_output.py)."""
        deltas = gen.tools.step(delta)
        if ending:
            deltas += gen.tools.finish()
        if not deltas and (frame.logprobs or ending):
            deltas = [ChatDelta()]
        logprobs = self.chat_logprobs(frame.logprobs)
        chunks = []
        for i, d in enumerate(deltas):
            last = ending and i == len(deltas) - 1
            choice = ChatStreamChoice(gen.index, d, logprobs if i == 0 else None,
                                      gen.output_finish_reason if last else None, gen.stop_reason if last else None)
            chunks.append(ChatCompletionChunk(gen.response_id, gen.created, gen.model, [choice], usage_so_far))
        return chunks

    def usage_chunk(self, gens: Sequence[Generation]):
        gen = gens[0]
        if gen.kind == "chat":
            return ChatCompletionChunk(gen.response_id, gen.created, gen.model, [], usage(gens))
        return CompletionChunk(gen.response_id, gen.created, gen.model, [], usage(gens))

    # ---- whole ---------------------------------------------------------------------------------

    def full_response(self, gens: Sequence[Generation]):
        gen = gens[0]
        scored = gen.options.prompt_logprobs is not None  # vLLM's prompt_logprobs asked for
        if gen.kind == "chat":
            choices = [self._chat_choice(g) for g in gens]
            if scored:
                return ScoredChatCompletionResponse(gen.response_id, gen.created, gen.model, choices, usage(gens),
                                                    prompt_logprobs=self.prompt_logprobs(gen))
            return ChatCompletionResponse(gen.response_id, gen.created, gen.model, choices, usage(gens))
        kind = ScoredCompletionChoice if scored else CompletionChoice
        choices = [kind(g.index, _text(g), self._whole_logprobs(g), g.finish_reason, g.stop_reason,
                        **({"prompt_logprobs": self.prompt_logprobs(g)} if scored else {})) for g in best_choices(gens)]
        return CompletionResponse(gen.response_id, gen.created, gen.model, choices, usage(gens))  # (every candidate's)

    def _whole_logprobs(self, gen: Generation) -> CompletionLogprobs | None:
        """A completion's logprobs: the echoed prompt's (if scored), then the answer's, their text
        offsets going on from the prompt's tokens (whose texts may not be the echo's: a BOS token)."""
        echoed = self.echo_logprobs(gen)
        if gen.echo_only or gen.options.logprobs is None:  # (best_of's ranking asked for the chosen tokens')
            return echoed
        return _joined(echoed, self.completion_logprobs(gen.logprobs, self._answer_offset(gen)))

    def _chat_choice(self, gen: Generation) -> ChatChoice:
        message, finish = ChatResponseMessage(gen.text), gen.finish_reason
        if gen.tools is not None:
            content, calls = gen.tools.final(gen.text)
            message = ChatResponseMessage(content, tool_calls=gen.tools.message_calls(calls))
            finish = gen.tools.finish_reason(bool(calls), finish, gen.stop_reason)
        return ChatChoice(gen.index, message, self.chat_logprobs(gen.logprobs), finish, gen.stop_reason)


class AnswerStream(Protocol):
    """A streamed answer's bytes (SSE), as its generations go."""

    def opening(self) -> bytes: ...

    def batch(self, gen: Generation, batch: list[tuple[str, TokenFrame]]) -> bytes: ...

    async def keep(self) -> None:
        """Before ``closing``: store the answer where its API keeps answers (the Responses API's)."""

    def closing(self) -> bytes: ...

    def failure(self, error: OpenAIError) -> bytes: ...


class Answer(Protocol):
    """Another API's shape of a request's answer (the Responses and Messages APIs), over its one
    generation: whole, or streamed."""

    response_id: str  # the id the answer carries (its generation's response_id)
    max_tokens_field: str  # its API's name for the bound on the output's tokens

    def whole(self, gens: list[Generation]) -> Any: ...

    def stream(self, gen: Generation) -> AnswerStream: ...

    async def keep(self, whole: Any) -> None:
        """Before ``whole`` is sent: store it where its API keeps answers (the Responses API's)."""


class ChoicesStream:
    """The stream of /v1/completions and /v1/chat/completions: each choice's chunks (opening with its
    first batch: a chat's role, an echo), the usage when asked for, then ``[DONE]``; an error as an
    error event, then ``[DONE]``."""

    def __init__(self, shapes: ResponseShapes, gens: Sequence[Generation]):
        self.shapes, self.gens = shapes, gens

    def opening(self) -> bytes:
        return b""

    def batch(self, gen: Generation, batch: list[tuple[str, TokenFrame]]) -> bytes:
        """A batch's events (one a frame that carries something), after the choice's opening chunks
        with its first batch (an echo's logprobs come with it)."""
        last = len(batch) - 1
        # (vLLM's: the choice's own prompt and output so far)
        running = usage([gen], this_choice=True) if gen.options.continuous_usage else None
        pending = sum(len(frame.token_ids) for _, frame in batch) if running else 0  # the batch's, not yet counted
        events = [] if gen.opened else [sse_event(c) for c in self.shapes.first_chunks(gen, _less(running, pending))]
        gen.opened = True
        for i, (delta, frame) in enumerate(batch):  # each chunk the usage as of its own frame
            pending -= len(frame.token_ids) if running else 0
            events += [sse_event(chunk) for chunk in self.shapes.chunks(gen, delta, frame, i == last,
                                                                         _less(running, pending))]
        return b"".join(events)

    async def keep(self) -> None:
        pass  # completions and chat completions are not stored

    def closing(self) -> bytes:
        if self.gens[0].options.include_usage:
            return sse_event(self.shapes.usage_chunk(self.gens)) + SSE_DONE
        return SSE_DONE

    def failure(self, error: OpenAIError) -> bytes:
        return error.to_sse() + SSE_DONE


def _less(running: Usage | None, tokens: int) -> Usage | None:
    """The usage ``running`` counts less ``tokens`` output tokens (what it was before them)."""
    if running is None or not tokens:
        return running
    return msgspec.structs.replace(running, completion_tokens=running.completion_tokens - tokens,
                                   total_tokens=running.total_tokens - tokens)


def best_choices(gens: Sequence[Generation]) -> Sequence[Generation]:
    """The choices a completion answers: with ``best_of``, each prompt's ``n`` candidates of the highest
    cumulative logprob (its tokens'; the first of equals first), indexed ``p * n + rank``; else all."""
    per, n = gens[0].options.best_of, gens[0].options.n
    if per is None:
        return gens
    best = []
    for p, start in enumerate(range(0, len(gens), per)):
        ranked = sorted(gens[start:start + per], key=lambda g: -sum(e.logprob for e in g.logprobs))
        for rank, gen in enumerate(ranked[:n]):
            gen.index = p * n + rank
            best.append(gen)
    return best


def _text(gen: Generation) -> str:
    """A completion choice's text: the echo, then the answer (not with max_tokens=0: the echo alone)."""
    return gen.echo if gen.echo_only else gen.echo + gen.text


def _joined(head: CompletionLogprobs | None, tail: CompletionLogprobs | None) -> CompletionLogprobs | None:
    """``head``'s entries, then ``tail``'s (either may be ``None``)."""
    if head is None or tail is None:
        return head or tail
    return CompletionLogprobs(tokens=head.tokens + tail.tokens, token_logprobs=head.token_logprobs + tail.token_logprobs,
                              top_logprobs=head.top_logprobs + tail.top_logprobs,
                              text_offset=head.text_offset + tail.text_offset)
