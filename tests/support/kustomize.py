"""``kustomize build`` for the subset ``k8s/`` uses, so tests can render every overlay without the
kustomize binary: ``resources`` (files, and directories holding a kustomization), ``namespace``,
``images`` (``newName``/``newTag`` for containers whose image is ``name``) and ``patches`` that are
JSON 6902 operation lists (``add``, ``replace``, ``remove``; ``-`` appends) applied to the
resources a ``target`` (kind, name) selects.  Anything else in a kustomization is refused, so a
feature the renderer does not know cannot silently go unrendered."""
from __future__ import annotations

import copy
from pathlib import Path

import yaml

KNOWN_FIELDS = {"apiVersion", "kind", "resources", "namespace", "images", "patches"}


def build(directory: Path) -> list[dict]:
    directory = Path(directory)
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - KNOWN_FIELDS
    if unknown:
        raise ValueError(f"{directory}: kustomization fields this renderer does not handle: {sorted(unknown)}")
    docs: list[dict] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        if path.is_dir():
            docs += build(path)
        else:
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for patch in spec.get("patches", []):
        ops = yaml.safe_load((directory / patch["path"]).read_text()) if "path" in patch else yaml.safe_load(patch["patch"])
        if not isinstance(ops, list):
            raise ValueError(f"{directory}: only JSON 6902 patches (operation lists) are handled")
        targets = [d for d in docs if all(d.get("kind") == v if k == "kind" else d["metadata"].get(k) == v
                                          for k, v in patch["target"].items())]
        if not targets:
            raise ValueError(f"{directory}: patch {patch} selects nothing")
        for doc in targets:
            for op in ops:
                apply(doc, op)
    for image in spec.get("images", []):
        for doc in docs:
            for container in _containers(doc):
                if container.get("image", "").split(":")[0] == image["name"]:
                    container["image"] = f"{image.get('newName', image['name'])}:{image.get('newTag', 'latest')}"
    if "namespace" in spec:
        for doc in docs:
            doc["metadata"]["namespace"] = spec["namespace"]
    return docs


def _containers(doc: dict) -> list[dict]:
    pod = doc.get("spec", {}).get("template", {}).get("spec", {})
    return pod.get("containers", []) + pod.get("initContainers", [])


def apply(doc: dict, op: dict) -> None:
    """One JSON 6902 operation on ``doc``; raises where the path does not exist (as kustomize does)."""
    parts = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].lstrip("/").split("/")]
    parent = doc
    for part in parts[:-1]:
        parent = parent[int(part)] if isinstance(parent, list) else parent[part]
    last = parts[-1]
    value = copy.deepcopy(op.get("value"))
    kind = op["op"]
    if isinstance(parent, list):
        if kind == "add":
            parent.insert(len(parent) if last == "-" else int(last), value)
        elif kind == "replace":
            parent[int(last)] = value
        elif kind == "remove":
            del parent[int(last)]
        else:
            raise ValueError(f"unsupported patch operation {kind!r}")
    else:
        if kind in ("replace", "remove") and last not in parent:
            raise KeyError(f"{op['path']}: no such field")
        if kind in ("add", "replace"):
            parent[last] = value
        elif kind == "remove":
            del parent[last]
        else:
            raise ValueError(f"unsupported patch operation {kind!r}")
