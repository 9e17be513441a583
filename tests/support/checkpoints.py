"""Tiny random checkpoints written to disk, so tests exercise the real loader."""
from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 512


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.2,
    )
    fields.update(overrides)
    return LlamaConfig(**fields)


def tiny_gemma3_config(**overrides):
    from transformers import Gemma3TextConfig

    fields = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
        sliding_window=8, layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=32, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=0.2, tie_word_embeddings=False,
    )
    fields.update(overrides)
    return Gemma3TextConfig(**fields)


def random_prompts(lengths, seed: int = 0) -> list[list[int]]:
    """Prompts of these lengths, random token ids inside the tiny models' vocabulary (from 3, past
    the special tokens), the same for a seed."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def write_checkpoint(config, directory: Path, seed: int = 0) -> Path:
    """Build a random model from ``config`` with a fixed seed and save it as safetensors."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if config.model_type == "gemma3_text":
        # Random norms around 0 would make Gemma's (1 + w) scaling trivial; spread them out.
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.normal_(0.0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def hf_greedy(directory: Path, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The reference: transformers ``generate`` in fp32, greedy, EOS ignored."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
            do_sample=False, eos_token_id=None, pad_token_id=0,
        )
    return out[0, len(prompt):].tolist()


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Disaggregated serving splits prefill and decode across two pools of workers.",
    "KV cache blocks move from the prefill worker to the decode worker over UCX.",
    "Hello world! Streaming tokens to many concurrent clients, café, naïve, 日本語, emoji 🙂.",
    "user assistant system: you are a helpful assistant; answer briefly.",
]


def write_tokenizer(directory: Path, vocab_size: int = VOCAB, chat_template: str | None = CHAT_TEMPLATE) -> Path:
    """A byte-level BPE tokenizer trained on a few sentences, with ``chat_template`` (None: none).

    Ids 0, 1, 2 are <pad>, <bos>, <eos> like the tiny configs; any text encodes (byte level).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<bos>", "<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>")
    if chat_template is not None:
        fast.chat_template = chat_template
    fast.save_pretrained(directory)
    return directory


class GreedyReference:
    """transformers' generate() on a checkpoint, fp32 greedy, EOS ignored; memoised per prompt."""

    def __init__(self, directory: Path, max_new: int = 10):
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        self.max_new = max_new
        self.cache: dict = {}

    def __call__(self, prompt: list[int], max_new: int | None = None) -> list[int]:
        max_new = self.max_new if max_new is None else max_new
        key = (tuple(prompt), max_new)
        if key not in self.cache:
            with torch.no_grad():
                out = self.model.generate(torch.tensor([prompt]), max_new_tokens=max_new, min_new_tokens=max_new,
                                          do_sample=False, eos_token_id=None, pad_token_id=0)
            self.cache[key] = out[0, len(prompt):].tolist()
        return self.cache[key]

