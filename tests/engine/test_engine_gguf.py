"""The engine loads a .gguf file directly (converted once into the cache) and, for every supported
architecture, generates exactly what transformers generates from the original weights."""
import pytest
import torch

from common.engine.config import EngineConfig
from common.engine.engine import Engine
from tests.support.gguf_checkpoints import CASES, tiny_model, write_gguf


@pytest.mark.parametrize("arch", list(CASES))
def test_engine_on_gguf_matches_transformers(tmp_path, monkeypatch, arch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    model = tiny_model(arch)
    path = tmp_path / f"tiny-{arch}.gguf"
    write_gguf(model, arch, path)
    prompts = [list(range(5, 5 + n)) for n in (3, 11, 19)]
    engine = Engine(EngineConfig(model=str(path), num_blocks=64, block_size=4, max_num_batched_tokens=8))
    results = engine.generate(prompts, {"max_tokens": 8, "temperature": 0, "ignore_eos": True})
    for prompt, result in zip(prompts, results):
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)
        assert result.token_ids == out[0, len(prompt):].tolist()
