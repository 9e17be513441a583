"""The answers' shapes for an echoed, scored prompt (``ResponseShapes``; a stub tokenizer: the
shapes are the code under test): the prompt's tokens first, the first without a logprob, then the
answer's, the text offsets going on from the prompt's tokens even where their texts are not the
echo's (a BOS token's "<bos>")."""
from __future__ import annotations

import json

from common.cluster.messages import TokenFrame, TokenLogprob
from gateway.generation import Generation
from gateway.openai_protocol import parse_completion_request
from gateway.response_shapes import ChoicesStream, ResponseShapes
from tests.support.request_bodies import completion

TEXTS = {1: "<bos>", 5: "Hello", 6: " world", 7: "!", 8: " Bye"}


class StubTokenizer:
    def decode(self, ids: list[int]) -> str:
        return "".join(TEXTS[i] for i in ids)


def scored_generation(prompt_logprobs) -> Generation:
    options = parse_completion_request(completion(echo=True, logprobs=1)).sampling()
    gen = Generation("cmpl-1", "completion", "m", [1, 5, 6], options, None, echo="Hello world")
    gen.prompt_logprobs = prompt_logprobs
    gen.token_ids, gen.pieces = [7, 8], ["!", " Bye"]
    gen.logprobs = [TokenLogprob(7, -0.5, [(7, -0.5)]), TokenLogprob(8, -1.5, [(6, -1.0)])]
    gen.finish_reason = "length"
    return gen


def test_an_echoed_prompt_is_scored_before_the_answer():
    shapes = ResponseShapes(StubTokenizer())
    gen = scored_generation([TokenLogprob(5, -2.0, [(6, -1.0)]), TokenLogprob(6, -3.0, [(6, -3.0)])])
    choice = shapes.full_response([gen]).choices[0]
    logprobs = choice.logprobs
    assert choice.text == "Hello world! Bye"
    assert logprobs.tokens == ["<bos>", "Hello", " world", "!", " Bye"]
    assert logprobs.token_logprobs == [None, -2.0, -3.0, -0.5, -1.5]
    # each position shows the token that is there too, first (OpenAI's legacy API, vLLM: up to logprobs + 1)
    assert logprobs.top_logprobs == [None, {"Hello": -2.0, " world": -1.0}, {" world": -3.0}, {"!": -0.5},
                                     {" Bye": -1.5, " world": -1.0}]
    assert [list(top) for top in logprobs.top_logprobs[1:]] == [["Hello", " world"], [" world"], ["!"],
                                                                [" Bye", " world"]]
    assert logprobs.text_offset == [0, 5, 10, 16, 17]
    # Streamed: the echo's chunk carries the prompt's part; the answer's chunks go on with the offsets.
    (chunk,) = shapes.first_chunks(gen)
    assert chunk.choices[0].text == "Hello world" and chunk.choices[0].logprobs.token_logprobs == [None, -2.0, -3.0]
    streamed = [shapes.chunks(gen, piece, TokenFrame(token_ids=[t], logprobs=[e]), False, None)[0].choices[0]
                for piece, t, e in zip(gen.pieces, gen.token_ids, gen.logprobs)]
    assert [c.logprobs.text_offset for c in streamed] == [[16], [17]]


def test_a_streamed_answers_text_offsets_run_on_from_chunk_to_chunk():
    shapes = ResponseShapes(StubTokenizer())
    gen = scored_generation(None)
    gen.echo = ""
    streamed = [shapes.chunks(gen, piece, TokenFrame(token_ids=[t], logprobs=[e]), False, None)[0].choices[0]
                for piece, t, e in zip(gen.pieces, gen.token_ids, gen.logprobs)]
    whole = shapes.full_response([gen]).choices[0].logprobs.text_offset
    assert [c.logprobs.text_offset[0] for c in streamed] == whole == [0, 1]


def test_without_scores_only_the_answer_has_logprobs():
    shapes = ResponseShapes(StubTokenizer())
    logprobs = shapes.full_response([scored_generation(None)]).choices[0].logprobs
    assert logprobs.tokens == ["!", " Bye"] and logprobs.text_offset == [11, 12]
    # A one-token prompt is scored with no entry: its token alone, without a logprob.
    assert shapes.echo_logprobs(scored_generation([])).token_logprobs == [None]


def test_max_tokens_0_answers_the_echo_alone():
    """The token generated for it is neither in the text nor in the logprobs, streamed or not."""
    shapes = ResponseShapes(StubTokenizer())
    gen = scored_generation([TokenLogprob(5, -2.0, [(6, -1.0)]), TokenLogprob(6, -3.0, [(6, -3.0)])])
    gen.echo_only = True
    choice = shapes.full_response([gen]).choices[0]
    assert choice.text == "Hello world" and choice.logprobs.token_logprobs == [None, -2.0, -3.0]
    frame = TokenFrame(token_ids=[7], logprobs=[TokenLogprob(7, -0.5, [(7, -0.5)])], finished=True,
                       finish_reason="length")
    (chunk,) = shapes.chunks(gen, "!", frame, True, None)
    assert chunk.choices[0].text == "" and chunk.choices[0].logprobs is None
    assert chunk.choices[0].finish_reason == "length"


def test_a_forbidden_tokens_logprob_is_a_number_not_minus_infinity():
    """-inf (a token a grammar or a bias forbids) would be null in JSON, which OpenAI's schema and
    clients refuse: it is shown as vLLM shows it."""
    shapes = ResponseShapes(StubTokenizer())
    entries = [TokenLogprob(7, 0.0, [(7, 0.0), (8, float("-inf")), (6, float("nan"))]),
               TokenLogprob(8, float("-inf"), [])]
    chat = shapes.chat_logprobs(entries).content
    assert [t.logprob for t in chat[0].top_logprobs] == [0.0, -9999.0, -9999.0] and chat[1].logprob == -9999.0
    completion = shapes.completion_logprobs(entries, 0)
    assert completion.top_logprobs[0] == {"!": 0.0, " Bye": -9999.0, " world": -9999.0}
    assert completion.token_logprobs == [0.0, -9999.0]


def test_best_of_answers_each_prompts_likeliest_candidates_and_counts_them_all():
    options = parse_completion_request(completion(prompt=["a", "b"], n=2, best_of=3)).sampling()
    assert (options.best_of, options.n) == (3, 2)
    scores = [[-3.0], [-0.5, -0.25], [-1.0], [-2.0], [-9.0, -1.0], [-0.1]]  # each candidate's tokens' logprobs
    gens = []
    for i, lps in enumerate(scores):
        gen = Generation(f"c-{i}", "completion", "m", [1, 5], options, None, index=i, first_choice=i % 3 == 0)
        gen.token_ids, gen.pieces = [7] * len(lps), [f"<{i}>"] + [""] * (len(lps) - 1)
        gen.logprobs = [TokenLogprob(7, lp, []) for lp in lps]
        gen.finish_reason = "length"
        gens.append(gen)
    answer = ResponseShapes(StubTokenizer()).full_response(gens)
    # prompt a: candidates 1 (-0.75), 2 (-1.0), 0 (-3.0); prompt b: 5 (-0.1), 3 (-2.0), 4 (-10.0)
    assert [(c.index, c.text) for c in answer.choices] == [(0, "<1>"), (1, "<2>"), (2, "<5>"), (3, "<3>")]
    assert all(c.logprobs is None for c in answer.choices)  # (asked for by the ranking, not by the client)
    assert answer.usage.completion_tokens == 8 and answer.usage.prompt_tokens == 4  # every candidate's


def test_continuous_usage_counts_each_chunks_own_tokens_in_a_batch():
    """A batch of frames (a client a few steps behind) gives each chunk the usage as of its frame."""
    options = parse_completion_request(completion(stream=True, stream_options={
        "include_usage": True, "continuous_usage_stats": True})).sampling()
    gen = Generation("cmpl-1", "completion", "m", [1, 5], options, None)
    frames = [("!", TokenFrame(token_ids=[7])), (" Bye", TokenFrame(token_ids=[8])), ("!", TokenFrame(token_ids=[7]))]
    gen.token_ids = [7, 8, 7]  # (the handler counts a batch's tokens before shaping it)
    data = ChoicesStream(ResponseShapes(StubTokenizer()), [gen]).batch(gen, frames)
    chunks = [json.loads(line[len("data: "):]) for line in data.decode().split("\n\n") if line]
    assert [c["usage"]["completion_tokens"] for c in chunks] == [1, 2, 3]
    assert {c["usage"]["prompt_tokens"] for c in chunks} == {2}


def test_every_chunk_of_a_stream_has_the_requests_created_time(monkeypatch):
    """OpenAI: "Each chunk has the same timestamp" (vLLM: the request's); a stream that outlasts a
    second showed several.  The clock here moves a second at each reading."""
    import itertools
    import time

    clock = itertools.count(1_700_000_000)
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))
    shapes = ResponseShapes(StubTokenizer())
    gen = scored_generation(None)  # (its ``created``: read when it was made)
    chunks = [*shapes.first_chunks(gen)]
    chunks += [c for piece, t in zip(gen.pieces, gen.token_ids)
               for c in shapes.chunks(gen, piece, TokenFrame(token_ids=[t]), False, None)]
    chunks += [shapes.usage_chunk([gen]), shapes.full_response([gen])]
    assert {c.created for c in chunks} == {gen.created}
