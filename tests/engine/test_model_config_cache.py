"""A worker derives its ModelConfig through transformers once per config.json; later starts read it
back from the cache without importing transformers, and get the same config."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from common.engine.model_config import ModelConfig, load_hf_config, load_model_config
from tests.support.checkpoints import tiny_llama_config, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
import json, sys
from pathlib import Path
from common.engine.model_config import load_model_config
config = load_model_config(Path(sys.argv[1]), cache_dir=Path(sys.argv[2]))
print(json.dumps({"transformers_imported": "transformers" in sys.modules, "config": config.to_json()}))
"""


def probe(checkpoint: Path, cache: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(checkpoint), str(cache)], cwd=ROOT, check=True,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_second_load_reads_the_cache_without_transformers(tmp_path):
    checkpoint, cache = tmp_path / "model", tmp_path / "cache"
    write_checkpoint(tiny_llama_config(), checkpoint)
    first, second = probe(checkpoint, cache), probe(checkpoint, cache)
    assert first["transformers_imported"] and not second["transformers_imported"]
    assert second["config"] == first["config"]
    derived = ModelConfig.from_hf_config(load_hf_config(checkpoint))
    assert ModelConfig.from_json(second["config"]) == derived


def test_a_changed_config_or_a_corrupt_entry_is_derived_again(tmp_path):
    checkpoint, cache = tmp_path / "model", tmp_path / "cache"
    write_checkpoint(tiny_llama_config(), checkpoint)
    before = load_model_config(checkpoint, cache)
    (entry,) = (cache / "model_configs").iterdir()
    entry.write_text("{not json")
    assert load_model_config(checkpoint, cache) == before  # rewritten
    assert ModelConfig.from_json(json.loads(entry.read_text())) == before

    raw = json.loads((checkpoint / "config.json").read_text())
    raw["rms_norm_eps"] = 0.125
    (checkpoint / "config.json").write_text(json.dumps(raw))
    after = load_model_config(checkpoint, cache)
    assert after.rms_norm_eps == 0.125 and before.rms_norm_eps != 0.125
    assert len(list((cache / "model_configs").iterdir())) == 2


def test_an_unwritable_cache_is_skipped(tmp_path):
    checkpoint = tmp_path / "model"
    write_checkpoint(tiny_llama_config(), checkpoint)
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache directory would go")
    assert load_model_config(checkpoint, blocker) == load_model_config(checkpoint, tmp_path / "cache")
