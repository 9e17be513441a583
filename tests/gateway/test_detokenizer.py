"""Incremental detokenization and stop strings, with real tokenizers trained in the test.

Two tokenizers cover the two ways streaming goes wrong: a GPT-2 style byte-level BPE (multi-byte
characters split across tokens) and a Llama/SentencePiece style BPE with byte fallback and a
decoder that strips the first leading space.
"""
from __future__ import annotations

import json
import random

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher, StreamingDecoder

CORPUS = [
    "The café serves crème brûlée and naïve jokes.",
    "日本の首都は東京です。日本語を話します。",
    "Emoji time 🎉🚀 and 👍🏽 are fun 🎉.",
    "Hello world, hello again. The quick brown fox jumps over the lazy dog.",
    "Ünïcödé tëxt with àccents, ñ and ß; Ελληνικά και русский текст.",
] * 3

SAMPLES = [
    "Hello world, the café is open 🎉!",
    "日本語のテキスト and English, mixed 👍🏽 here.",
    " leading space, then  double  spaces and a trailing one ",
    "Unseen: 😀 ∑ ∫ 𝔘 — all via bytes.",
]


def byte_level_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


def sentencepiece_bpe() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.Replace(" ", "▁")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  limit_alphabet=60, show_progress=False)
    tok.train_from_iterator(CORPUS, trainer)
    # Rebuild as Llama's tokenizer.json looks: byte-fallback tokens <0x00>..<0xFF>, "▁" prepended,
    # and the decoder chain Replace(▁→space) / ByteFallback / Fuse / Strip(one leading space).
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    base = len(vocab)
    vocab.update({f"<0x{b:02X}>": base + b for b in range(256)})
    spec["model"]["byte_fallback"] = True
    spec["normalizer"] = {"type": "Sequence", "normalizers": [
        {"type": "Prepend", "prepend": "▁"},
        {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}
    spec["decoder"] = {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"}, {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
                                   unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module", params=["byte_level", "sentencepiece"])
def tokenizer(request) -> PreTrainedTokenizerFast:
    return byte_level_bpe() if request.param == "byte_level" else sentencepiece_bpe()


def full_decode(tok, ids) -> str:
    return tok.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], rng: random.Random) -> list[str]:
    pieces, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 3)
        pieces.append(detok.add(ids[i:i + n]))
        i += n
    pieces.append(detok.finish())
    return pieces


def test_the_tokenizers_really_split_characters(tokenizer):
    # Guard for the tests below: some sample must put one character across several tokens.
    split = False
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        split |= any("\ufffd" in full_decode(tokenizer, [t]) for t in ids)
    assert split


def test_streaming_real_text_emits_only_complete_characters(tokenizer):
    rng = random.Random(1)
    for text in SAMPLES:
        ids = tokenizer.encode(text, add_special_tokens=False)
        detok = IncrementalDetokenizer(tokenizer)
        pieces = [detok.add([t]) for t in ids] + [detok.finish()]
        assert "".join(pieces) == full_decode(tokenizer, ids)
        assert not any("\ufffd" in p for p in pieces), pieces
        assert detok.text == "".join(pieces) and detok.generated_token_ids == ids
        # Chunked arrival (several tokens per step) gives the same text.
        assert "".join(stream(IncrementalDetokenizer(tokenizer), ids, rng)) == full_decode(tokenizer, ids)


BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
RANDOM_CHARS = "aé日本🎉👍🏽∑ßж \n"


def random_ids(tok, rng: random.Random, n: int) -> list[int]:
    """Random token ids.  With a byte-fallback vocabulary, byte tokens only come as whole UTF-8
    characters (see test_invalid_byte_fallback_runs for why); otherwise anything goes."""
    byte_ids = set(tok.convert_tokens_to_ids(BYTE_TOKENS)) - {tok.unk_token_id, None}
    if not byte_ids:
        return [rng.randrange(len(tok)) for _ in range(n)]
    others = [i for i in range(len(tok)) if i not in byte_ids]
    ids: list[int] = []
    while len(ids) < n:
        if rng.random() < 0.3:
            ch = rng.choice(RANDOM_CHARS)
            ids += tok.convert_tokens_to_ids([f"<0x{b:02X}>" for b in ch.encode()])
        else:
            ids.append(rng.choice(others))
    return ids


def test_random_token_sequences_concatenate_to_the_full_decode(tokenizer):
    rng = random.Random(0)
    for _ in range(400):
        ids = random_ids(tokenizer, rng, rng.randint(1, 40))
        pieces = stream(IncrementalDetokenizer(tokenizer), ids, rng)
        assert "".join(pieces) == full_decode(tokenizer, ids), ids


def test_invalid_byte_fallback_runs():
    # Llama's ByteFallback decoder turns a whole run of byte tokens into U+FFFD once any byte in
    # it is invalid, after the fact.  Streaming has shown the valid character by then: it shows
    # what was valid when it arrived.  Only garbage byte runs differ from a full decode.
    tok = sentencepiece_bpe()
    ids = tok.convert_tokens_to_ids(["<0xE6>", "<0x97>", "<0xA5>", "<0x3F>", "<0xE2>"]) + [tok.unk_token_id]
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add([t]) for t in ids) + detok.finish()
    assert streamed == "日?\ufffd"
    assert full_decode(tok, ids) == "\ufffd" * 5


def test_prompt_context_keeps_the_first_tokens_leading_space(tokenizer):
    prompt = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    # The continuation as a model would produce it: its first token carries the space ("Ġjumps"
    # byte-level, "▁jumps" SentencePiece, whose encoder adds the "▁" itself).
    generated = next(g for g in (tokenizer.encode(t, add_special_tokens=False)
                                 for t in (" jumps over 日本 🎉", "jumps over 日本 🎉"))
                     if full_decode(tokenizer, prompt + g) == "The quick brown fox jumps over 日本 🎉")
    if tokenizer.convert_ids_to_tokens(generated[0]).startswith("▁"):
        assert full_decode(tokenizer, generated) == "jumps over 日本 🎉"  # alone, the space is lost
    detok = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join(detok.add([t]) for t in generated) + detok.finish()
    assert text == " jumps over 日本 🎉"
    assert detok.generated_token_ids == generated


def test_random_continuations_of_a_prompt(tokenizer):
    rng = random.Random(2)
    prompt = tokenizer.encode("Hello world, the café", add_special_tokens=False)
    prompt_text = full_decode(tokenizer, prompt)
    for _ in range(200):
        gen = random_ids(tokenizer, rng, rng.randint(1, 30))
        whole = full_decode(tokenizer, prompt + gen)
        assert whole.startswith(prompt_text)
        assert "".join(stream(IncrementalDetokenizer(tokenizer, prompt), gen, rng)) == whole[len(prompt_text):]


def test_special_tokens_are_skipped(tokenizer):
    ids = tokenizer.encode("fun 🎉", add_special_tokens=False) + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add([t]) for t in ids) + detok.finish() == full_decode(tokenizer, ids)
    keep = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert (keep.add(ids) + keep.finish()).endswith(tokenizer.eos_token)


def test_bad_token_ids_are_rejected(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    with pytest.raises(ValueError, match="non-negative ints"):
        detok.add([-1])
    with pytest.raises(ValueError, match="non-negative ints"):
        detok.add(["5"])
    assert detok.add([]) == "" and detok.finish() == ""


# ---- stop strings -------------------------------------------------------------------------------

def reference_stop(text: str, stops: list[str], unchecked: int = 0) -> tuple[str, str | None]:
    """Scan character by character: the first stop string to complete past the first ``unchecked``
    characters wins, and the text ends where it begins (vLLM's: in those characters too)."""
    for end in range(unchecked + 1, len(text) + 1):
        for s in sorted(stops, key=len, reverse=True):
            if text[:end].endswith(s):
                return text[:end - len(s)], s
    return text, None


def feed_all(matcher: StopStringMatcher, pieces: list[str]) -> list[str]:
    return [matcher.feed(p) for p in pieces] + [matcher.flush()]


def test_stop_string_split_across_pieces_is_withheld_then_cut():
    m = StopStringMatcher(["\n\nUser:"])
    out = feed_all(m, ["Sure.", "\n", "\nUs", "er:", " more"])
    assert out == ["Sure.", "", "", "", "", ""] and m.matched == "\n\nUser:"


def test_withheld_text_is_released_when_it_diverges_or_at_the_end():
    m = StopStringMatcher(["STOP"])
    assert m.feed("abc ST") == "abc "
    assert m.feed("OR") == "STOR"  # "STOR" cannot become "STOP"
    assert m.feed("x S") == "x "
    assert m.flush() == "S" and m.matched is None


def test_include_stop_and_earliest_completion_wins():
    m = StopStringMatcher(["bc", "abcd"], include_stop=True)
    assert m.feed("xabcd") == "xabc" and m.matched == "bc"
    assert m.feed("more") == "" and m.flush() == ""
    # Two stops completing at the same character: the longer (earlier starting) one cuts.
    m = StopStringMatcher(["cd", "bcd"])
    assert m.feed("abcde") == "a" and m.matched == "bcd"
    assert StopStringMatcher([]).feed("anything") == "anything"
    with pytest.raises(ValueError, match="non-empty"):
        StopStringMatcher([""])


def random_cases(seed: int, alphabet: str, count: int = 500):
    """``(text, stop strings, the text in pieces)``: random, from a few characters so stops occur."""
    rng = random.Random(seed)
    for _ in range(count):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(1, 3))]
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 5)
            pieces.append(text[i:i + n])
            i += n
        yield rng, text, stops, pieces


def test_stop_matching_does_not_depend_on_how_text_is_split():
    for _, text, stops, pieces in random_cases(3, "ab日🎉 \n"):
        m = StopStringMatcher(stops)
        assert ("".join(feed_all(m, pieces)), m.matched) == reference_stop(text, stops), (text, stops, pieces)


def test_a_stop_ending_in_unchecked_text_is_not_matched_and_one_beginning_there_cuts_it():
    """min_tokens (vLLM's semantics): stop strings are looked for once the output is long enough;
    a stop that ends before then stays text, one that ends after it is matched and the output ends
    where it began -- in the unchecked text too, so a tail of it that could begin one is withheld."""
    for rng, text, stops, pieces in random_cases(5, "ab日 \n"):
        skipped = rng.randint(0, len(pieces))
        m = StopStringMatcher(stops)
        out = [m.feed(p, check=k >= skipped) for k, p in enumerate(pieces)] + [m.flush()]
        unchecked = sum(len(p) for p in pieces[:skipped])
        assert ("".join(out), m.matched) == reference_stop(text, stops, unchecked), (text, stops, pieces, skipped)
    m = StopStringMatcher(["quick brown"])
    assert [m.feed("The quick", check=False), m.feed(" brown fox")] == ["The ", ""]
    assert m.matched == "quick brown"


@pytest.mark.parametrize("prompt", ["", "Say:"])
@pytest.mark.parametrize("text, stop", [("ab ab ab cd", "ab"), ("日本 ab 日本 🎉 ab", "日本"), ("🎉🎉🎉 x", "🎉")])
def test_the_decoder_looks_for_stop_strings_past_min_tokens_only(tokenizer, prompt, text, stop):
    """The first ``min_tokens`` tokens' text (their complete characters, after the prompt's) is
    never cut, though a character spelled out over several tokens reaches the matcher a step or
    more after its first token."""
    context = tokenizer.encode(prompt, add_special_tokens=False)
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = StreamingDecoder(tokenizer, context)
    whole_text = "".join(whole.step([t]) for t in ids) + whole.finish()
    for min_tokens in range(len(ids) + 1):
        dec = StreamingDecoder(tokenizer, context, stop=[stop], min_tokens=min_tokens)
        out = ""
        for t in ids:
            out += dec.step([t])
            if dec.stopped:
                break
        out += dec.finish()
        unchecked = (len(full_decode(tokenizer, context + ids[:min_tokens]).rstrip("\ufffd"))
                     - len(full_decode(tokenizer, context)))
        assert (out, dec.matched_stop) == reference_stop(whole_text, [stop], unchecked), min_tokens


def test_streaming_decoder_stops_on_text_split_across_tokens(tokenizer):
    ids = tokenizer.encode("The café is open 🎉! Hello world", add_special_tokens=False)
    dec = StreamingDecoder(tokenizer, stop=["🎉!"])
    out = []
    for t in ids:
        out.append(dec.step([t]))
        if dec.stopped:
            break
    out.append(dec.finish())
    assert "".join(out) == "The café is open " and dec.matched_stop == "🎉!"

    dec = StreamingDecoder(tokenizer, stop=["never"])
    text = "".join(dec.step([t]) for t in ids) + dec.finish()
    assert text == full_decode(tokenizer, ids) and not dec.stopped


def test_tokenizers_without_a_rust_backend_use_decode(tokenizer):
    class DecodeOnly:  # e.g. a slow (Python) tokenizer: only decode() is available
        def __init__(self, inner):
            self.inner = inner

        def decode(self, ids, skip_special_tokens, clean_up_tokenization_spaces):
            assert clean_up_tokenization_spaces is False  # clean-up would break concatenation
            return self.inner.decode(ids, skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    rng = random.Random(4)
    for _ in range(50):
        ids = random_ids(tokenizer, rng, rng.randint(1, 20))
        assert "".join(stream(IncrementalDetokenizer(DecodeOnly(tokenizer)), ids, rng)) == full_decode(tokenizer, ids)
    with pytest.raises(TypeError, match="no decode"):
        IncrementalDetokenizer(object())


# ---- linear work ---------------------------------------------------------------------------------


def gpt2_byte_char(b: int) -> str:
    """The character GPT-2's byte-level alphabet uses for byte ``b``."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    if b in printable:
        return chr(b)
    return chr(256 + [x for x in range(256) if x not in printable].index(b))


class CountingTokenizer:
    """A real tokenizer's ``decode``, counting the token ids it is asked to decode (the text work)."""

    def __init__(self, tok):
        self.tok = tok
        self.decoded = 0

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def test_output_that_keeps_ending_in_replacement_characters_costs_linear_work(tokenizer):
    # A lone continuation byte is invalid UTF-8 for ever: the text keeps ending in U+FFFD.  Holding
    # it all back would re-decode an ever longer window on every token (2000 tokens: ~2 million ids).
    lone = "<0x80>" if "<0x80>" in tokenizer.get_vocab() else gpt2_byte_char(0x80)
    garbage = tokenizer.convert_tokens_to_ids(lone)
    assert full_decode(tokenizer, [garbage]).endswith("\ufffd")
    n = 2000
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting)
    pieces = [detok.add([garbage]) for _ in range(n)] + [detok.finish()]
    assert "".join(pieces) == full_decode(tokenizer, [garbage] * n)
    assert counting.decoded <= 50 * n, counting.decoded
    assert "".join(pieces[: n // 2])  # and it streams instead of waiting for the end
