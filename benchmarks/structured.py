"""Structured output's cost: grammar-constrained vs free sampled decoding, on one engine, one run.

    python benchmarks/structured.py            # the default model (Gemma 3 270M, 262k-token vocabulary)
    python benchmarks/structured.py --quick    # a tiny random Llama with a 512-token vocabulary

A batch of 16 sampled requests (temperature 1, one seed each) under a JSON schema, then the same
16 requests free, each held to the length its constrained twin produced (ignore_eos), each run
computing its prompts (the prefix cache emptied): the same tokens to compute, so ``json_schema_over_free_throughput`` (output tok/s constrained / free) is the
grammar's whole cost per step (mask fill, mask application, matcher advance).  Also:

    mask_us_per_row_step   time the sampler spends on grammars per constrained row per step (the
                           masks applied, and any wait for their fill)
    mask_fill_us_per_row_step  the fill itself (in a thread, while the model runs)
    first_compile_ms       compiling a schema not seen before (the backend already built)
    cached_compile_ms      the same schema again (the compiler's cache)
    backend_build_ms       building the backend once (the tokenizer's vocabulary converted)
    valid_fraction         constrained outputs that parse and validate against the schema (must be 1.0)

The last line of stdout is one JSON object.
"""
from __future__ import annotations

import argparse
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.engine import compute_process  # noqa: E402

compute_process.configure()  # before torch loads OpenMP and before other threads start

import jsonschema  # noqa: E402

import common.engine.sampler as sampler_module  # noqa: E402
import common.engine.structured.masking as masking  # noqa: E402
from benchmarks.bench_util import emit  # noqa: E402
from common.engine.config import EngineConfig  # noqa: E402
from common.engine.engine import Engine  # noqa: E402
from common.engine.sampling_params import SamplingParams  # noqa: E402
from common.engine.structured.spec import StructuredOutput  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "maxLength": 32},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "active": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "email", "tags", "active", "role"],
    "additionalProperties": False,
}
OTHER_SCHEMA = {"type": "object", "properties": {"id": {"type": "integer"}, "note": {"type": "string", "maxLength": 40}},
                "required": ["id", "note"], "additionalProperties": False}
PROMPTS = ["Write the user's record as JSON:", "A customer profile:", "Here is one account, as JSON:",
           "Output a person object."]


class FillTimer:
    """Wraps the grammar mask fill (run ahead of the sampler, in a thread, while the model runs)."""

    def __init__(self):
        self.seconds = 0.0
        self.rows = 0
        self._fill = masking.fill_bitmasks

    def __call__(self, matchers, words):
        began = time.perf_counter()
        self._fill(matchers, words)
        self.seconds += time.perf_counter() - began
        self.rows += len(matchers)


class RuleTimer:
    """Wraps the sampler's logit rules: seconds spent and constrained rows seen."""

    def __init__(self):
        self.seconds = 0.0
        self.row_steps = 0
        self._apply = sampler_module.apply_logit_rules

    def __call__(self, logits, rows, masks):
        began = time.perf_counter()
        kept = self._apply(logits, rows, masks)
        self.seconds += time.perf_counter() - began
        self.row_steps += sum(1 for row in rows if row.grammar is not None)
        return kept  # (the logprobs' logits, where they differ: the sampler reads them)


def checkpoint(args) -> str:
    if not args.quick:
        return "default"
    from tests.support.checkpoints import tiny_llama_config, write_checkpoint, write_tokenizer

    directory = Path(tempfile.mkdtemp(prefix="structured-bench-"))
    write_checkpoint(tiny_llama_config(max_position_embeddings=4096), directory)
    write_tokenizer(directory)
    return str(directory)


def run(engine: Engine, prompts: list[str], params: list[SamplingParams]):
    engine.block_pool.reset_prefix_cache()  # every run computes its prompts
    ids = [engine.add_request(p, q) for p, q in zip(prompts, params)]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    began = time.perf_counter()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    seconds = time.perf_counter() - began
    return [tokens[i] for i in ids], seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--rounds", type=int, default=4, help="constrained batches (seeds differ) for valid_fraction")
    p.add_argument("--backend", default="llguidance", choices=("llguidance", "xgrammar"))
    args = p.parse_args()

    engine = Engine(EngineConfig(model=checkpoint(args), num_blocks=2048, block_size=16, max_num_seqs=args.batch,
                                 max_num_batched_tokens=512, structured_output_backend=args.backend))
    compiler = engine.grammars
    spec = StructuredOutput("json_schema", json.dumps(SCHEMA))
    began = time.perf_counter()
    compiler.compile(StructuredOutput("json_object"))  # builds the backend
    backend_build_ms = (time.perf_counter() - began) * 1e3
    began = time.perf_counter()
    compiler.compile(spec)
    first_compile_ms = (time.perf_counter() - began) * 1e3
    began = time.perf_counter()
    for _ in range(10):
        compiler.compile(spec)
    cached_compile_ms = (time.perf_counter() - began) * 1e3 / 10
    began = time.perf_counter()
    compiler.compile(StructuredOutput("json_schema", json.dumps(OTHER_SCHEMA)))
    second_schema_ms = (time.perf_counter() - began) * 1e3

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.batch)]
    engine.generate(prompts[:2], SamplingParams(max_tokens=4, structured=spec))  # warm-up both paths
    engine.generate(prompts[:2], SamplingParams(max_tokens=4))
    timer = RuleTimer()
    sampler_module.apply_logit_rules = timer
    valid, total, constrained_tokens, constrained_s, free_tokens, free_s = 0, 0, 0, 0.0, 0, 0.0
    rule_seconds, row_steps, fill_seconds, fill_rows = 0.0, 0, 0.0, 0
    for round_ in range(args.rounds):
        params = [SamplingParams(max_tokens=256, temperature=1.0, seed=1000 * round_ + i, structured=spec)
                  for i in range(args.batch)]
        sampler_module.apply_logit_rules = timer = RuleTimer()
        masking.fill_bitmasks = fills = FillTimer()
        try:
            outputs, seconds = run(engine, prompts, params)
        finally:
            sampler_module.apply_logit_rules = timer._apply
            masking.fill_bitmasks = fills._fill
        fill_seconds, fill_rows = fill_seconds + fills.seconds, fill_rows + fills.rows
        rule_seconds, row_steps = rule_seconds + timer.seconds, row_steps + timer.row_steps
        constrained_tokens += sum(map(len, outputs))
        constrained_s += seconds
        for o in outputs:
            total += 1
            try:
                jsonschema.validate(json.loads(engine.tokenizer.decode(o, skip_special_tokens=True)), SCHEMA)
                valid += 1
            except (ValueError, jsonschema.ValidationError):
                pass
        # The free twin: the same prompts, seeds and lengths, no grammar.
        free_params = [SamplingParams(max_tokens=max(len(o), 1), temperature=1.0, seed=1000 * round_ + i,
                                      ignore_eos=True) for i, o in enumerate(outputs)]
        free_outputs, seconds = run(engine, prompts, free_params)
        free_tokens += sum(map(len, free_outputs))
        free_s += seconds
    constrained_tps = constrained_tokens / constrained_s
    free_tps = free_tokens / free_s
    emit({
        "benchmark": "structured", "model": "tiny-llama-512" if args.quick else "gemma-3-270m",
        "backend": args.backend, "batch": args.batch, "vocab": engine.model_config.vocab_size,
        "constrained_output_tok_s": round(constrained_tps, 1), "free_output_tok_s": round(free_tps, 1),
        "json_schema_over_free_throughput": round(constrained_tps / free_tps, 3),
        "mask_us_per_row_step": round(rule_seconds / max(row_steps, 1) * 1e6, 1),
        "mask_fill_us_per_row_step": round(fill_seconds / max(fill_rows, 1) * 1e6, 1),
        "backend_build_ms": round(backend_build_ms, 1), "first_compile_ms": round(first_compile_ms, 2),
        "second_schema_compile_ms": round(second_schema_ms, 2), "cached_compile_ms": round(cached_compile_ms, 4),
        "valid_fraction": valid / total, "outputs": total, "mean_output_tokens": round(constrained_tokens / total, 1),
    })


if __name__ == "__main__":
    main()
