"""The prepack cache (``common/engine/loading/prepack_cache.py``): a quantized load packs its weights
once and a later load of the same checkpoint and settings reads them back -- the same weights,
the same logits -- while a changed checkpoint or setting, a damaged file or one of another model
is a miss that quantizes again."""
from __future__ import annotations

import logging
import os

import pytest
import torch

from common.engine.loading.model_loader import load_model
from common.engine.loading.prepack_cache import DIRECTORY, PrepackCache
from common.engine.models.quantization_scheme import Quantization
from common.engine.models.quantized import quantize_weight, restore_weight
from tests.support.checkpoints import tiny_gemma3_config, tiny_llama_config, write_checkpoint

CPU = torch.device("cpu")


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / DIRECTORY


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # untied head, and every output count a multiple of 16 (int4's packing)
    return write_checkpoint(tiny_llama_config(), tmp_path_factory.mktemp("prepack") / "llama")


def logits_of(model, positions=8):
    """The model's logits for one short prompt (its own KV cache and attention)."""
    from common.engine.attention.interface import AttentionRequest
    from common.engine.attention.selection import make_attention
    from common.engine.kv.kv_cache import KVCache, KVLayout

    cfg = model.cfg
    layout = KVLayout(model_id="t", dtype="float32", block_size=16, num_layers=cfg.num_layers,
                      num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim)
    attention = make_attention("torch", CPU, {cfg.window(i) for i in range(cfg.num_layers)}, 16, torch.float32)
    meta = attention.prepare([AttentionRequest(0, positions, positions, [0])], CPU)
    hidden = model(torch.arange(3, 3 + positions), torch.arange(positions), KVCache(layout, 2, CPU), meta, attention)
    return model.logits(hidden)


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_a_second_load_reads_the_packed_weights_and_computes_the_same(llama, cache_root, scheme):
    quantization = Quantization(scheme)
    first, _ = load_model(llama, torch.float32, CPU, quantization=quantization)
    assert not first.used_prepacked
    files = list(cache_root.glob("*.safetensors"))
    assert len(files) == 1 and f"-{scheme}-" in files[0].name
    second, _ = load_model(llama, torch.float32, CPU, quantization=quantization)
    assert second.used_prepacked
    a, b = first.quantized_weights(), second.quantized_weights()
    assert a.keys() == b.keys() and len(a) == 2 * 4 + 2  # 2 layers: qkv, o, gate_up, down; the head; the embedding
    for name in a:
        for part, tensor in a[name].packed_tensors().items():
            assert torch.equal(tensor.view(torch.uint8), b[name].packed_tensors()[part].view(torch.uint8)), (name, part)
    assert torch.equal(logits_of(first), logits_of(second))


def test_a_tied_head_is_stored_once_and_shared_again(tmp_path, cache_root):
    checkpoint = write_checkpoint(tiny_gemma3_config(tie_word_embeddings=True), tmp_path / "gemma")
    load_model(checkpoint, torch.float32, CPU, quantization=Quantization("int8"))
    model, _ = load_model(checkpoint, torch.float32, CPU, quantization=Quantization("int8"))
    assert model.used_prepacked
    assert model.quantized_lm_head is model.model.embed_tokens.quantized  # one copy, as a fresh load has


def test_another_setting_or_a_changed_checkpoint_packs_again_and_the_stale_file_goes(tmp_path, cache_root):
    checkpoint = write_checkpoint(tiny_llama_config(), tmp_path / "llama")
    load_model(checkpoint, torch.float32, CPU, quantization=Quantization("int4", 32))
    other, _ = load_model(checkpoint, torch.float32, CPU, quantization=Quantization("int4", 64))
    assert not other.used_prepacked  # the group size is part of the key
    assert len(list(cache_root.glob("*.safetensors"))) == 2
    # New weights under the same path: the old packing must not be served for them.
    weights = checkpoint / "model.safetensors"
    write_checkpoint(tiny_llama_config(), checkpoint, seed=1)
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 1_000_000_000))
    reloaded, _ = load_model(checkpoint, torch.float32, CPU, quantization=Quantization("int4", 32))
    assert not reloaded.used_prepacked
    names = sorted(f.name for f in cache_root.glob("*.safetensors"))
    assert len(names) == 2 and sum("-g32-" in n for n in names) == 1  # the stale g32 file was replaced


def test_a_damaged_file_is_a_miss_that_packs_again(llama, cache_root, caplog):
    load_model(llama, torch.float32, CPU, quantization=Quantization("int8"))
    (path,) = cache_root.glob("*.safetensors")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with caplog.at_level(logging.WARNING, logger="common.engine.loading.prepack_cache"):
        model, _ = load_model(llama, torch.float32, CPU, quantization=Quantization("int8"))
    assert not model.used_prepacked
    assert "unusable" in caplog.text
    model, _ = load_model(llama, torch.float32, CPU, quantization=Quantization("int8"))
    assert model.used_prepacked  # written again whole


def test_weights_of_another_model_under_the_key_are_not_used(tmp_path, llama, cache_root, caplog):
    small = write_checkpoint(tiny_llama_config(intermediate_size=96), tmp_path / "small")
    load_model(small, torch.float32, CPU, quantization=Quantization("int8"))
    (foreign,) = cache_root.glob("*.safetensors")
    os.replace(foreign, PrepackCache.for_checkpoint(llama, Quantization("int8"), torch.float32).path)
    with caplog.at_level(logging.WARNING):
        model, _ = load_model(llama, torch.float32, CPU, quantization=Quantization("int8"))
    assert not model.used_prepacked
    assert "do not match" in caplog.text


def test_entries_of_checkpoints_that_are_gone_are_removed(tmp_path, llama, cache_root):
    gone = write_checkpoint(tiny_llama_config(), tmp_path / "gone")
    load_model(gone, torch.float32, CPU, quantization=Quantization("int8"))
    for file in gone.iterdir():
        file.unlink()
    gone.rmdir()
    load_model(llama, torch.float32, CPU, quantization=Quantization("int8"))
    assert [f.name.startswith("llama-") for f in cache_root.glob("*.safetensors")] == [True]


def test_an_unwritable_cache_only_costs_the_saving(llama, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("")
    monkeypatch.setenv("PDSERVE_CACHE", str(blocker))
    model, _ = load_model(llama, torch.float32, CPU, quantization=Quantization("int8"))
    assert not model.used_prepacked and model.quantized_weights()


@pytest.mark.parametrize("scheme", ["int8", "int4", "fp8"])
def test_restoring_refuses_tensors_that_do_not_fit_the_description(scheme):
    weight = quantize_weight(torch.randn(32, 64), scheme, 32)
    tensors = weight.packed_tensors()
    assert torch.equal(restore_weight(weight.describe(), tensors).dequantize(), weight.dequantize())
    with pytest.raises(ValueError):
        restore_weight({**weight.describe(), "out_features": 48}, tensors)
    with pytest.raises(ValueError):
        restore_weight(weight.describe(), {k: v[:-1] for k, v in tensors.items()})
    with pytest.raises(ValueError):
        restore_weight({k: v for k, v in weight.describe().items() if k != "dtype"}, tensors)


def test_a_file_that_another_process_removes_meanwhile_costs_nothing(tmp_path, llama, cache_root, monkeypatch):
    """Workers sharing the cache remove each other's stale files: one that goes between being
    listed and being opened (torch then fails to map it: a RuntimeError) neither fails the load
    that looks at it as a possibly stale entry nor the one that meant to read it."""
    import safetensors

    other = write_checkpoint(tiny_llama_config(), tmp_path / "other")
    load_model(other, torch.float32, CPU, quantization=Quantization("int8"))

    def vanishing(path, *args, **kwargs):
        os.unlink(path)
        raise RuntimeError(f"unable to open file <{path}> in read-only mode: No such file or directory (2)")

    monkeypatch.setattr(safetensors, "safe_open", vanishing)
    load_model(llama, torch.float32, CPU, quantization=Quantization("int8"))  # looks at other's file
    assert [f.name.startswith("llama-") for f in cache_root.glob("*.safetensors")] == [True]
    model, _ = load_model(llama, torch.float32, CPU, quantization=Quantization("int8"))  # its own goes
    assert not model.used_prepacked and model.quantized_weights()
