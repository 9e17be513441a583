"""Streaming text out of token ids: incremental detokenization and stop strings.

Decoding token by token is wrong in two ways: a multi-byte UTF-8 character can be split across
byte-level tokens (decoding half of it gives U+FFFD), and SentencePiece decoders drop the leading
space of the *first* token they see, so ``decode([t])`` of a mid-sentence "▁world" is "world".
``IncrementalDetokenizer`` keeps two offsets into the token list and decodes a small window::

    tokens   ... [prefix_offset ........ read_offset ......... end]
                  \\_ already emitted _/ \\_ new, not emitted _/
    prefix_text = decode(tokens[prefix_offset:read_offset])
    new_text    = decode(tokens[prefix_offset:])
    emit new_text[len(prefix_text):]   unless new_text ends in U+FFFD (an unfinished character)

Both strings start at the same token, so a dropped leading space or a stray replacement character
at the window start cancels out.

The window stays short, so the work per token is constant.  Output that keeps ending in U+FFFD
(a run of invalid bytes, which never completes) would otherwise hold ``read_offset`` back and grow
the window without end -- quadratic work.  Once more than ``MAX_HELD_TOKENS`` tokens are held, the
text up to all but the last ``CHAR_TOKENS`` tokens is emitted if it is final: a character still
being spelled out started within the last 3 tokens (UTF-8 characters are at most 4 bytes, a token
carries at least one), and the cut text must read the same when decoded with each of the tokens
after the cut (so the cut splits no character, even under ByteFallback, which rewrites a whole byte
run).  Past ``FORCE_HELD_TOKENS`` the cut is made regardless, which only a decoder that keeps
rewriting earlier text could notice.  The window starts a few prompt tokens back, so the first
generated token is decoded in context.  The streamed pieces concatenate to ``decode(generated)``
(``finish()`` releases a trailing unfinished character as U+FFFD, as a full decode would).  One
exception: Llama's ByteFallback decoder turns a whole run of byte tokens into U+FFFD once any byte
in it is invalid, after the fact; streaming has already shown the characters that were valid, so
only garbage byte runs read differently from a full decode.  Use the streamed text as the answer
(also for non-streaming requests) so both modes agree.

``StopStringMatcher`` withholds text that may be the start of a stop string and truncates at the
first complete one.  ``StreamingDecoder`` chains the two.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

REPLACEMENT = "\ufffd"
INITIAL_CONTEXT_TOKENS = 5  # prompt tokens decoded with the first generated ones (as vLLM does)
MAX_HELD_TOKENS = 8  # tokens held back (text ending in U+FFFD) before the final part is emitted anyway
CHAR_TOKENS = 4  # a character still being spelled out lies within this many trailing tokens
FORCE_HELD_TOKENS = 64  # beyond this many held tokens the cut is made regardless: the work stays linear


def _decode_fn(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    # The Rust tokenizer directly when there is one: same text as transformers' decode without
    # clean-up (which rewrites " ." to "." and would break the concatenation property), less overhead.
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and hasattr(backend, "decode"):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    if not hasattr(tokenizer, "decode"):
        raise TypeError(f"tokenizer {type(tokenizer).__name__} has no decode()")
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


class IncrementalDetokenizer:
    """Turns a growing list of generated token ids into text deltas, emitting only complete text.

    ``tokenizer``: a Hugging Face tokenizer (fast or slow) or anything with the same ``decode``.
    ``prompt_token_ids``: the prompt, whose last few tokens give the first tokens their context.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), *,
                 skip_special_tokens: bool = True, context_tokens: int = INITIAL_CONTEXT_TOKENS) -> None:
        if context_tokens < 0:
            raise ValueError(f"context_tokens must be >= 0, got {context_tokens}")
        self._decode = _decode_fn(tokenizer, skip_special_tokens)
        context = list(prompt_token_ids[-context_tokens:]) if context_tokens else []
        self._tokens: list[int] = context
        self._num_context = len(context)
        self.prefix_offset = 0
        self.read_offset = len(context)
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    @property
    def generated_token_ids(self) -> list[int]:
        return self._tokens[self._num_context:]

    def text_length_of(self, n: int) -> int:
        """How long the text of the first ``n`` generated tokens is: its complete characters (one
        they begin to spell out is not theirs), emitted a step or a few after them."""
        context = self._tokens[:self._num_context]
        text = self._decode(self._tokens[:self._num_context + n]).rstrip(REPLACEMENT)
        return len(text) - len(self._decode(context))

    def add(self, token_ids: Iterable[int]) -> str:
        """Append generated tokens; return the text they complete (possibly "")."""
        new_ids = list(token_ids)
        for t in new_ids:
            if not isinstance(t, int) or t < 0:
                raise ValueError(f"token ids must be non-negative ints, got {t!r}")
        if not new_ids:
            return ""
        self._tokens.extend(new_ids)
        return self._emit(final=False)

    def finish(self) -> str:
        """End of generation: return whatever is still held back (an unfinished character)."""
        return self._emit(final=True)

    def _emit(self, *, final: bool) -> str:
        if self.read_offset == len(self._tokens):
            return ""
        prefix_text = self._decode(self._tokens[self.prefix_offset:self.read_offset])
        new_text = self._decode(self._tokens[self.prefix_offset:])
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT)):
            # Nothing new yet, or the last character is still being spelled out byte by byte.
            return self._emit_final_part(prefix_text, new_text)
        return self._advance(new_text[len(prefix_text):], len(self._tokens))

    def _emit_final_part(self, prefix_text: str, new_text: str) -> str:
        """Text is held back: emit what can no longer change once too much is held (module docstring)."""
        held = len(self._tokens) - self.read_offset
        if held <= MAX_HELD_TOKENS:
            return ""
        end = len(self._tokens)
        cut = end - CHAR_TOKENS
        cut_text = self._decode(self._tokens[self.prefix_offset:cut])
        if len(cut_text) <= len(prefix_text):
            return ""
        if held <= FORCE_HELD_TOKENS:
            longer = [new_text] + [self._decode(self._tokens[self.prefix_offset:i]) for i in range(cut + 1, end)]
            if not all(text.startswith(cut_text) for text in longer):
                return ""
        return self._advance(cut_text[len(prefix_text):], cut)

    def _advance(self, delta: str, read_offset: int) -> str:
        self.prefix_offset = self.read_offset
        self.read_offset = read_offset
        self._pieces.append(delta)
        return delta


class StopStringMatcher:
    """Finds stop strings in streamed text.

    ``feed(text)`` returns the text that is safe to show: everything except a tail that could
    still grow into a stop string.  When a stop string completes, the text is cut before it (or
    after it, with ``include_stop``), ``matched`` is set, and later input is ignored.
    ``flush()`` releases the withheld tail at the end of generation.  ``feed(text, check=False)``
    takes ``text`` unchecked (an output shorter than its ``min_tokens``, as vLLM does): a stop
    string that ends in it is not matched; one that ends in later text may begin in it, and cuts
    the output there (its tail that could begin one is withheld as ever).
    """

    def __init__(self, stop: Sequence[str], *, include_stop: bool = False) -> None:
        stop = [stop] if isinstance(stop, str) else list(stop)
        for s in stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self.stop = stop
        self.include_stop = include_stop
        self.matched: str | None = None
        self._held = ""  # not shown yet: it could grow into a stop string
        self._shown_tail = ""  # the last text shown, as long as a stop string could reach back
        self._max_hold = max((len(s) for s in stop), default=1) - 1

    def feed(self, text: str, check: bool = True) -> str:
        if self.matched is not None or not text:
            return ""
        if not self.stop:
            return text
        shown = self._shown_tail
        buf = shown + self._held + text
        if check:
            # The stop that completes first wins (ties: the one starting first), so the result does
            # not depend on how the text was split into pieces.  Only one that ends in ``text`` is
            # new: what came before was checked, or taken unchecked.
            hit_at, hit = -1, None
            new_from = len(buf) - len(text)
            for s in self.stop:
                i = buf.find(s, max(0, new_from - len(s) + 1))
                if i != -1 and (hit is None or (i + len(s), i) < (hit_at + len(hit), hit_at)):
                    hit_at, hit = i, s
            if hit is not None:
                self.matched = hit
                self._held = self._shown_tail = ""
                return buf[len(shown):hit_at + (len(hit) if self.include_stop else 0)]  # (none, if it began in shown text)
        hold = min(self._partial_suffix(buf), len(buf) - len(shown))
        end = len(buf) - hold
        self._held = buf[end:]
        self._shown_tail = buf[max(0, end - self._max_hold):end] if self._max_hold else ""
        return buf[len(shown):end]

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest suffix of ``buf`` that is a proper prefix of some stop string."""
        for k in range(min(self._max_hold, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(s.startswith(tail) for s in self.stop):
                return k
        return 0

    def flush(self) -> str:
        held, self._held = self._held, ""
        return "" if self.matched is not None else held


class StreamingDecoder:
    """Token ids in, displayable text out: ``IncrementalDetokenizer`` then ``StopStringMatcher``.

    ``step(ids)`` returns the text to send; once ``stopped`` the caller aborts the request.
    ``finish()`` returns the last text when generation ends for any other reason.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] = (), stop: Sequence[str] = (), *,
                 skip_special_tokens: bool = True, include_stop: bool = False, min_tokens: int = 0) -> None:
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens)
        self.matcher = StopStringMatcher(stop, include_stop=include_stop)
        self.min_tokens = min_tokens  # stop strings are looked for once the output has more tokens
        self._generated = 0  # tokens
        self._unchecked: int | None = 0 if min_tokens <= 0 else None  # the first min_tokens tokens' text, once known
        self._fed = 0  # text given to the matcher

    @property
    def stopped(self) -> bool:
        return self.matcher.matched is not None

    @property
    def matched_stop(self) -> str | None:
        return self.matcher.matched

    def step(self, token_ids: Iterable[int]) -> str:
        if self.stopped:
            return ""
        token_ids = list(token_ids)
        self._generated += len(token_ids)
        text = self.detok.add(token_ids)
        if self._unchecked is None and self._generated > self.min_tokens:
            self._unchecked = self.detok.text_length_of(self.min_tokens)
        return self._feed(text)

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._feed(self.detok.finish()) + self.matcher.flush()

    def _feed(self, text: str) -> str:
        """The first ``min_tokens`` tokens' text goes to the matcher unchecked (vLLM's ``min_tokens``),
        the rest checked."""
        free = len(text) if self._unchecked is None else max(0, min(len(text), self._unchecked - self._fed))
        self._fed += len(text)
        if not free:  # (every token past them, and every token without min_tokens: one feed)
            return self.matcher.feed(text)
        return self.matcher.feed(text[:free], check=False) + self.matcher.feed(text[free:])
