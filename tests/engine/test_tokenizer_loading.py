"""``load_tokenizer`` gives what ``AutoTokenizer`` gives -- the same class, the same ids, text and
chat prompts -- and, for a checkpoint naming the generic class, without importing torch (the
gateway's start-up)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from common.engine.loading.tokenizer import load_tokenizer
from tests.support.checkpoints import TRAINING_TEXT, write_tokenizer

TEXTS = ["", "Hello world", "  spaces\tand\nlines  ", "ünïcödé 日本語 🙂", "<bos> inline <eos>", *TRAINING_TEXT[:3]]


@pytest.fixture(scope="module")
def generic(tmp_path_factory):
    return write_tokenizer(tmp_path_factory.mktemp("generic"))


@pytest.fixture(scope="module")
def model_specific(generic, tmp_path_factory):
    """The same files naming a model-specific class, which ``AutoTokenizer`` builds its own way."""
    directory = tmp_path_factory.mktemp("specific")
    for path in generic.iterdir():
        shutil.copy(path, directory / path.name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    return directory


@pytest.mark.parametrize("which", ["generic", "model_specific"])
def test_the_tokenizer_is_the_one_auto_tokenizer_loads(which, request):
    checkpoint = request.getfixturevalue(which)
    ours, auto = load_tokenizer(checkpoint), AutoTokenizer.from_pretrained(checkpoint)
    assert type(ours) is type(auto)
    for text in TEXTS:
        ids = auto(text).input_ids
        assert ours(text).input_ids == ids
        assert ours.decode(ids) == auto.decode(ids)
    assert (ours.bos_token_id, ours.eos_token_id, ours.all_special_ids) == (
        auto.bos_token_id, auto.eos_token_id, auto.all_special_ids)
    messages = [{"role": "user", "content": "hi"}]
    assert (ours.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))


def test_a_generic_tokenizer_loads_without_torch(generic):
    probe = ("import sys\nfrom common.engine.loading.tokenizer import load_tokenizer\n"
             f"load_tokenizer({str(generic)!r})('hello')\nprint('torch' in sys.modules)\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"


def test_a_directory_without_a_tokenizer_raises_as_auto_tokenizer_does(tmp_path):
    with pytest.raises((OSError, ValueError)):
        load_tokenizer(tmp_path)
