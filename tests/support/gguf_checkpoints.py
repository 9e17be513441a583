"""Tiny GGUF checkpoints for tests: a small random transformers model per architecture, written the
way llama.cpp's convert_hf_to_gguf.py would (names from gguf-py's TensorNameMap, Q/K row
permutation for llama, +1 on Gemma norms, llama3 rope factors as a rope_freqs tensor)."""
from __future__ import annotations

import gguf
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

Q = gguf.GGMLQuantizationType

TINY = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
            rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)

CASES = {
    "llama": dict(TINY, model_type="llama", tie_word_embeddings=False, max_position_embeddings=65536,
                  rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}),
    "qwen2": dict(TINY, model_type="qwen2", tie_word_embeddings=True,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "qwen3": dict(TINY, model_type="qwen3", tie_word_embeddings=False,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}),
    "gemma3": dict(TINY, model_type="gemma3_text", num_hidden_layers=7, sliding_window=4,
                   query_pre_attn_scalar=64, tie_word_embeddings=True),
}
GGUF_ARCH = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2,
             "qwen3": gguf.MODEL_ARCH.QWEN3, "gemma3": gguf.MODEL_ARCH.GEMMA3}


def tiny_model(case: str):
    """A tiny random transformers model of ``case`` (an architecture of CASES), norms randomized."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CASES[case])).eval()
    with torch.no_grad():  # norms start at 0 or 1; randomize them so a wrong shift or swap shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, arch: str, path, qtype=Q.F32, name="tiny", chat_template: str | None = None,
               qtype_of=None) -> None:
    """Convert ``model`` the way convert_hf_to_gguf.py would and write it to ``path`` (with
    ``chat_template`` as ``tokenizer.chat_template``, when given).  Matrices are stored as
    ``qtype``, or as ``qtype_of(hf_name)`` where that is given and says something."""
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_bos_token_id(cfg.bos_token_id)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    # A toy sentencepiece-style vocabulary, so transformers can build a tokenizer from the file.
    w.add_tokenizer_model("llama")
    w.add_token_list(["<pad>", "<s>", "</s>", "<unk>"] + [f"\u2581t{i}" for i in range(cfg.vocab_size - 4)])
    w.add_token_scores([0.0] * 4 + [-float(i) for i in range(cfg.vocab_size - 4)])
    w.add_token_types([3, 3, 3, 2] + [1] * (cfg.vocab_size - 4))
    w.add_unk_token_id(3)
    if chat_template is not None:
        w.add_chat_template(chat_template)
    rope = cfg.rope_parameters
    if arch == "gemma3":
        w.add_rope_freq_base(rope["full_attention"]["rope_theta"])
        w.add_sliding_window(cfg.sliding_window)
    else:
        w.add_rope_freq_base(rope["rope_theta"])
        w.add_rope_dimension_count(cfg.head_dim)
    if arch == "llama" and rope["rope_type"] == "llama3":
        # llama.cpp stores llama3 scaling as per-frequency divisors of the default inv_freq.
        default = 1.0 / rope["rope_theta"] ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        w.add_tensor("rope_freqs.weight", (default / scaled).float().numpy())
    names = gguf.get_tensor_name_map(GGUF_ARCH[arch], cfg.num_hidden_layers)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        data = t.float().numpy().copy()
        if arch == "llama" and "q_proj" in hf_name:
            data = permute(data, cfg.num_attention_heads)
        if arch == "llama" and "k_proj" in hf_name:
            data = permute(data, cfg.num_key_value_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + 1
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        kind = (qtype_of(hf_name) if qtype_of else None) or qtype
        if kind != Q.F32 and data.ndim == 2:
            w.add_tensor(gguf_name, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(gguf_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
