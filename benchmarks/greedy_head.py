"""The screened greedy head against the logits path, on the default model's own head, in one run.

A greedy step needs each row's first maximal logit.  The logits path computes the whole fp32 LM
head product (Gemma 3 270M: 262144 x 640, tied to the embedding) and takes each row's maximum;
the screened head (``common/engine/models/greedy_head.py``) computes every logit from a bf16 copy
with a proven error bound and only the candidate panels in fp32.  The rows fed to both are the
model's own final hidden states, captured while it decodes random prompts greedily (random
vectors would make the screen's job easier or harder than real ones).  For each batch size:
medians of both, the speedup, the rows computed in fp32 per token, and whether every token is the
same (it must be: ``tokens_identical``); then default sampling (T = 1): the logits and the sampler
against the screen's rejection sampling, and the trials a row took.  The head is timed whatever the
batch; the engine gives it at most ``engine_max_rows`` rows (32 on AVX2, where more gain nothing).

    python benchmarks/greedy_head.py [--quick] [--rows 1,8,16,32,64]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_util import emit, median_ms  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.engine.models.greedy_head import screen_path, uniforms_per_row  # noqa: E402
from common.engine.sampler import Sampler, SamplingRow  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402


def capture_hidden(engine: Engine, count: int, seed: int) -> torch.Tensor:
    """``count`` final hidden states of greedy decoding (before the final norm), as the runner
    hands them to ``screened_tokens``."""
    captured: list[torch.Tensor] = []
    model = engine.model
    original = model.screened_tokens

    def record(hidden: torch.Tensor, inverse_temperatures: list[float]):
        captured.append(hidden.detach().clone())
        return original(hidden, inverse_temperatures)

    model.screened_tokens = record
    try:
        g = torch.Generator().manual_seed(seed)
        vocab = model.cfg.vocab_size
        prompts = [torch.randint(3, vocab, (int(n),), generator=g).tolist()
                   for n in torch.randint(16, 128, (8,), generator=g)]
        per_prompt = -(-count // len(prompts)) + 1
        engine.generate(prompts, {"max_tokens": per_prompt, "temperature": 0, "ignore_eos": True})
    finally:
        model.screened_tokens = original
    return torch.cat(captured)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="rows 1 and 16, fewer repetitions")
    parser.add_argument("--rows", default="1,8,16,32,64", help="comma-separated batch sizes")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    batch_sizes = [1, 16] if args.quick else [int(r) for r in args.rows.split(",")]
    repeats = 3 if args.quick else args.repeats

    engine = Engine(EngineConfig(model="default", dtype="float32", num_blocks=512), load_tokenizer=False)
    model = engine.model
    head = model.greedy_head
    if head is None:
        emit({"benchmark": "greedy_head", "skipped": "no screened head here (no AVX-512 or AVX2, or not an fp32 head)"})
        return
    hidden = capture_hidden(engine, max(batch_sizes), seed=0)
    result: dict = {"benchmark": "greedy_head", "model": "gemma-3-270m", "threads": args.threads,
                    "pass1": screen_path(), "head_rows": head.panels.out_features,
                    "bf16_copy_mb": round(head.nbytes / 1e6), "engine_max_rows": min(head.max_rows, 2**31),
                    "by_rows": {}}
    identical = True
    for n in batch_sizes:
        rows = hidden[:n]  # the two calls below also warm both paths up
        expected = model.logits(rows).max(dim=-1).indices
        before = head.exact_rows
        normed = model.model.norm(rows)  # the head itself, whatever rows the engine would give it (max_rows)
        got = head.argmax(normed)
        identical &= got is not None and torch.equal(got, expected)
        fp32_rows_per_token = (head.exact_rows - before) / n
        logits_ms = median_ms(lambda: model.logits(rows).max(dim=-1), repeats)
        screen_ms = median_ms(lambda: head.argmax(model.model.norm(rows)), repeats)
        # Default sampling (T = 1, no filters): the logits and the sampler against the screen's
        # rejection sampling (trials a row: how often a proposal was accepted).
        plain = [SamplingRow(SamplingParams(temperature=1.0))] * n
        sampler = Sampler()
        sampled_logits_ms = median_ms(lambda: sampler(model.logits(rows), plain), repeats)
        rows_before, trials_before = head.sampled_rows, head.sample_trials
        inverse = torch.ones(n)

        def screen_sample():
            uniforms = torch.rand(n, uniforms_per_row(), dtype=torch.float64)
            return head.sample(model.model.norm(rows), inverse, uniforms)

        sampled_screen_ms = median_ms(screen_sample, repeats)
        trials = (head.sample_trials - trials_before) / max(1, head.sampled_rows - rows_before)
        result["by_rows"][str(n)] = {"logits_ms": round(logits_ms, 2), "screen_ms": round(screen_ms, 2),
                                     "speedup": round(logits_ms / screen_ms, 2),
                                     "fp32_rows_per_token": round(fp32_rows_per_token, 1),
                                     "sampled_logits_ms": round(sampled_logits_ms, 2),
                                     "sampled_screen_ms": round(sampled_screen_ms, 2),
                                     "sampled_speedup": round(sampled_logits_ms / sampled_screen_ms, 2),
                                     "sample_trials_per_row": round(trials, 3)}
        print(f"rows={n:3d}  logits+max {logits_ms:7.2f} ms   screen {screen_ms:7.2f} ms   "
              f"{logits_ms / screen_ms:4.2f}x   {fp32_rows_per_token:.0f} rows in fp32 a token;  sampled: "
              f"logits+sampler {sampled_logits_ms:7.2f} ms   screen {sampled_screen_ms:7.2f} ms   "
              f"{sampled_logits_ms / sampled_screen_ms:4.2f}x   {trials:.3f} trials a row", file=sys.stderr)
    result["tokens_identical"] = identical
    result["fallbacks"] = head.fallbacks
    result["undecided_rows"] = head.undecided_rows  # sampled rows the screen left to the logits
    result["speedup_1_row"] = result["by_rows"][str(batch_sizes[0])]["speedup"]
    result["speedup_most_rows"] = result["by_rows"][str(batch_sizes[-1])]["speedup"]
    result["sampled_speedup_1_row"] = result["by_rows"][str(batch_sizes[0])]["sampled_speedup"]
    result["sampled_speedup_most_rows"] = result["by_rows"][str(batch_sizes[-1])]["sampled_speedup"]
    emit(result)


if __name__ == "__main__":
    main()
