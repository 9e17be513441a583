"""Bad input gets a clear error naming the problem, and frees whatever it held."""
import pytest

from common.engine.config import EngineConfig, scheduling_defaults
from common.engine.engine import Engine
from tests.support.checkpoints import tiny_gemma3_config, tiny_llama_config, write_checkpoint


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    directory = write_checkpoint(tiny_llama_config(max_position_embeddings=64), tmp_path_factory.mktemp("llama"))
    return Engine(EngineConfig(model=str(directory), num_blocks=32, block_size=4), load_tokenizer=False)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ([5] * 64, {"max_tokens": 4}, "context length is 64"),
        ([5, 6], {"max_tokens": 0}, "max_tokens must be >= 1"),
        ([], {"max_tokens": 4}, "prompt is empty"),
        ([5, 6], {"max_tokens": 4, "best_of": 3}, "unknown field `best_of`"),
        ([5, 6], {"temperature": -1}, "temperature must be >= 0"),
        ([5, 6], {"top_p": 0}, "top_p must be in"),
        ([5, 100000], {}, "token ids must be integers"),
        ("text", {}, "no tokenizer"),
    ],
)
def test_bad_requests_are_rejected_and_hold_nothing(engine, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    # The engine keeps serving.
    assert engine.generate([[5, 6, 7]], {"max_tokens": 2, "temperature": 0})[0].finish_reason in ("length", "stop")


def test_bad_request_in_a_batch_leaves_nothing_behind(engine):
    with pytest.raises(ValueError, match="max_tokens"):
        engine.generate([[5, 6], [7, 8]], {"max_tokens": -3})
    assert not engine.has_unfinished()


def test_abort_mid_generation_frees_blocks(engine):
    rid = engine.add_request([5] * 20, {"max_tokens": 20, "ignore_eos": True})
    engine.step()
    assert engine.block_pool.num_free_blocks < engine.block_pool.num_blocks
    assert engine.abort(rid) is True
    assert engine.abort(rid) is False
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    engine.block_pool.check_integrity()


def test_missing_checkpoint_path():
    with pytest.raises(FileNotFoundError, match="does not exist"):
        Engine(EngineConfig(model="/nonexistent/model", num_blocks=4))


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="no config.json"):
        Engine(EngineConfig(model=str(tmp_path), num_blocks=4))


def test_corrupt_weights(tmp_path):
    directory = write_checkpoint(tiny_llama_config(), tmp_path / "m")
    (directory / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="corrupt"):
        Engine(EngineConfig(model=str(directory), num_blocks=4))


def test_truncated_weights(tmp_path):
    directory = write_checkpoint(tiny_llama_config(), tmp_path / "m")
    weights = directory / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ValueError, match="corrupt"):
        Engine(EngineConfig(model=str(directory), num_blocks=4))


def test_unsupported_architecture(tmp_path):
    from transformers import GPT2Config

    directory = tmp_path / "gpt2"
    directory.mkdir()
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(directory)
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        Engine(EngineConfig(model=str(directory), num_blocks=4))


def test_attention_softcapping_is_refused_not_ignored(tmp_path):
    directory = write_checkpoint(tiny_gemma3_config(attn_logit_softcapping=50.0), tmp_path / "g")
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        Engine(EngineConfig(model=str(directory), num_blocks=4))


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"kv_memory_fraction": 1.5}, "kv_memory_fraction"),
        ({"dtype": "int8"}, "dtype"),
    ],
)
def test_invalid_config_names_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="default", **fields)


def test_a_batch_that_a_step_cannot_serve_whole_is_refused_and_a_default_one_is_cut_to_the_step():
    """More running requests than a step's tokens: the ones at the back would get no token while
    the front ones run (vLLM refuses it too)."""
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(8\) must be at least max_num_seqs \(16\)"):
        EngineConfig(model="default", max_num_batched_tokens=8, max_num_seqs=16)
    with pytest.raises(ValueError, match=r"\(512, the default on CPU\) must be at least max_num_seqs \(1024\)"):
        EngineConfig(model="default", max_num_seqs=1024).for_device("cpu")
    assert EngineConfig(model="default", max_num_batched_tokens=8).for_device("cpu").max_num_seqs == 8
    assert EngineConfig(model="default").for_device("cpu").max_num_seqs == scheduling_defaults("cpu").max_num_seqs
