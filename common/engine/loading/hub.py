"""Checkpoints from the Hugging Face Hub: ``hf:ORG/NAME[@REVISION]`` -> a local directory.

The files (config, tokenizer, safetensors weights; no other formats) go to
``<PDSERVE_CACHE>/hub/<NAME>`` (the directory's name is the model's default served id), with a
marker saying which repository and revision they are.  ``HF_TOKEN`` authenticates gated models;
with ``HF_HUB_OFFLINE=1``, or once the marker matches, nothing is fetched.  Concurrent processes
(the gateway and every worker of a host start together) serialize on a lock file, so the download
happens once.
"""
from __future__ import annotations

import fcntl
import json
import os
import re
from pathlib import Path

PREFIX = "hf:"
MARKER = ".pdserve-hub.json"
ALLOW = ["*.json", "*.safetensors", "tokenizer.model", "*.jinja", "*.txt"]
_SPEC = re.compile(r"^hf:([A-Za-z0-9][\w.-]*/[\w.-]+)(?:@([\w./-]+))?$")


def parse_spec(spec: str) -> tuple[str, str | None]:
    """``hf:ORG/NAME[@REVISION]`` -> (repo id, revision or None); ValueError naming the problem."""
    m = _SPEC.match(spec)
    if not m:
        raise ValueError(f"model {spec!r}: expected hf:ORG/NAME or hf:ORG/NAME@REVISION")
    return m.group(1), m.group(2)


def hub_checkpoint(spec: str, cache_dir: Path) -> Path:
    """The local directory holding ``spec``'s files, downloading them first if needed."""
    repo, revision = parse_spec(spec)
    target = cache_dir / "hub" / repo.split("/")[1]
    wanted = {"repo": repo, "revision": revision}
    target.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            marker = json.loads((target / MARKER).read_text())
        except (OSError, ValueError):
            marker = None
        if marker is not None and {k: marker.get(k) for k in wanted} == wanted:
            return target
        if marker is not None and marker.get("repo") != repo:
            raise ValueError(f"{target} holds {marker.get('repo')}, not {repo}: two models with the same name")
        if os.environ.get("HF_HUB_OFFLINE", "") in ("1", "true", "yes"):
            raise FileNotFoundError(f"{spec} is not in {target} and HF_HUB_OFFLINE is set")
        from huggingface_hub import snapshot_download

        snapshot_download(repo, revision=revision, local_dir=target, allow_patterns=ALLOW,
                          token=os.environ.get("HF_TOKEN") or None)
        (target / MARKER).write_text(json.dumps(wanted) + "\n")
    return target
