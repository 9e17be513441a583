"""``pdctl gen-secrets --k8s``: what it prints to run next names the Secret's namespace in every
command (an overlay applied elsewhere would find no Secret) and both overlays, each of which exists."""
from __future__ import annotations

import re

import yaml

from launcher.local_stack import ROOT
from pdctl import cli as pdctl


def commands(out: str) -> list[str]:
    return [line.split("#")[0].strip() for line in out.splitlines() if line.strip().startswith("kubectl")]


def test_the_next_steps_name_the_namespace_and_both_overlays(tmp_path, capsys):
    path = tmp_path / "secrets.yaml"
    assert pdctl.main(["gen-secrets", "--k8s", str(path), "--namespace", "serving"]) == 0
    assert yaml.safe_load(path.read_text())["metadata"]["namespace"] == "serving"
    out = capsys.readouterr().out
    cmds = commands(out)
    assert cmds[0] == f"kubectl apply -n serving -f {path}"
    overlays = [re.fullmatch(r"kubectl apply -n serving -k (k8s/overlays/\w+)", c).group(1) for c in cmds[1:]]
    assert sorted(overlays) == ["k8s/overlays/cpu", "k8s/overlays/gpu"]
    assert all((ROOT / o / "kustomization.yaml").is_file() for o in overlays)
    assert "namespace serving" in out


def test_without_a_namespace_the_commands_use_kubectls(tmp_path, capsys):
    path = tmp_path / "secrets.yaml"
    assert pdctl.main(["gen-secrets", "--k8s", str(path)]) == 0
    out = capsys.readouterr().out
    assert all(" -n " not in c for c in commands(out)) and len(commands(out)) == 3
    assert "--namespace" in out
