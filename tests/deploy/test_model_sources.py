"""Where compose deployments get models: a read-only /models (GGUF conversions land in
PDSERVE_CACHE, never next to the file) and the Hub (``hf:ORG/NAME``, cached with a marker)."""
from __future__ import annotations

import json
import os
import stat

import pytest

from common.engine.loading.hub import MARKER, parse_spec
from common.engine.loading.checkpoint_path import resolve_checkpoint
from tests.support.gguf_checkpoints import tiny_model, write_gguf


def test_gguf_on_a_read_only_mount_converts_into_the_cache(tmp_path, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    write_gguf(tiny_model("llama"), "llama", models / "tiny.gguf")
    models.chmod(stat.S_IRUSR | stat.S_IXUSR)  # read-only, as the compose files mount /models
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    try:
        out = resolve_checkpoint(str(models / "tiny.gguf"))
    finally:
        models.chmod(0o755)
    assert out.is_relative_to(tmp_path / "cache") and (out / "model.safetensors").is_file()
    assert sorted(p.name for p in models.iterdir()) == ["tiny.gguf"]


def test_hub_models_resolve_from_the_cache_without_network(tmp_path, monkeypatch):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = tmp_path / "hub" / "Tiny-1B"
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE"):
        resolve_checkpoint("hf:acme/Tiny-1B")
    (target / MARKER).write_text(json.dumps({"repo": "acme/Tiny-1B", "revision": None}))
    assert resolve_checkpoint("hf:acme/Tiny-1B") == target  # the directory name is the served id
    with pytest.raises(FileNotFoundError):  # another revision is not what the cache holds
        resolve_checkpoint("hf:acme/Tiny-1B@v2")
    with pytest.raises(ValueError, match="holds acme/Tiny-1B, not other/Tiny-1B"):
        resolve_checkpoint("hf:other/Tiny-1B")
    assert parse_spec("hf:acme/Tiny-1B@0123abc") == ("acme/Tiny-1B", "0123abc")
    for bad in ("hf:", "hf:noslash", "hf:../etc/passwd", "hf:a/b c"):
        with pytest.raises(ValueError, match="expected hf:ORG/NAME"):
            parse_spec(bad)
    assert os.environ["HF_HUB_OFFLINE"] == "1"
