"""Offline demo: generate from a few prompts with the default model (Gemma 3 270M) on this machine."""
from __future__ import annotations

import argparse
import logging
import time

from common.engine.config import EngineConfig
from common.engine.engine import Engine

PROMPTS = [
    "The capital of Germany is Berlin. The capital of France is",
    "A haiku about the sea:\n",
    "def is_prime(n):\n",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="default", help="HF checkpoint directory, .gguf file, or 'default'")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("prompts", nargs="*", help="prompts to complete (a few built-in ones if none)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    engine = Engine(EngineConfig(model=args.model, num_blocks=512, max_num_batched_tokens=512))
    prompts = args.prompts or PROMPTS
    start = time.perf_counter()
    results = engine.generate(prompts, {"max_tokens": args.max_tokens, "temperature": 0})
    elapsed = time.perf_counter() - start
    for prompt, result in zip(prompts, results):
        print(f"\n--- prompt: {prompt!r}\n{prompt}\033[1m{result.text}\033[0m")
    tokens = sum(len(r.token_ids) for r in results)
    print(f"\n{tokens} tokens in {elapsed:.1f} s ({tokens / elapsed:.1f} tok/s) — {engine.stats()}")


if __name__ == "__main__":
    main()
