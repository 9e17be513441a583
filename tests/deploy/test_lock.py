"""requirements/*.lock: the images install exactly these, hash-checked; they must pin every
dependency pyproject.toml declares, within its range, and the torch the tests run."""
from __future__ import annotations

import re
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from launcher.local_stack import ROOT

REQS = ROOT / "requirements"
# lock files an image installs -> the pyproject extras they must cover
IMAGES = {"cpu": (["cpu.lock", "cpu-torch.lock"], ["ucx"]), "gpu": (["gpu.lock", "flash-attn.lock"], ["gpu"])}


def read_lock(name: str) -> dict[str, tuple[str, list[str]]]:
    """name -> (pinned version, hashes), for every requirement of a pip-compile/uv lock file."""
    text = (REQS / name).read_text().replace("\\\n", " ")
    pins = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        m = re.match(r"([A-Za-z0-9_.\-\[\]]+)==(\S+)(.*)", line)
        assert m, f"{name}: not an exact pin: {line!r}"
        pins[canonicalize_name(m.group(1).split("[")[0])] = (m.group(2), re.findall(r"--hash=sha256:([0-9a-f]{64})", m.group(3)))
    return pins


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def torch_version_under_test() -> str:
    return re.search(r"pip install [^\n]*torch==([0-9.]+)", (ROOT / "Makefile").read_text()).group(1)


@pytest.mark.parametrize("image", sorted(IMAGES))
def test_every_pyproject_dependency_is_pinned_with_hashes(image):
    files, extras = IMAGES[image]
    pins = {}
    for name in files:
        pins.update(read_lock(name))
    project = pyproject()
    wanted = [Requirement(r) for r in project["dependencies"]]
    for extra in extras:
        wanted += [Requirement(r) for r in project["optional-dependencies"][extra]]
    for req in wanted:
        name = canonicalize_name(req.name)
        assert name in pins, f"{image}: {req.name} (pyproject) is not in {files}"
        version, hashes = pins[name]
        assert req.specifier.contains(Version(version), prereleases=True), f"{image}: {req.name}=={version} not {req.specifier}"
    for name, (version, hashes) in pins.items():
        assert hashes, f"{image}: {name}=={version} has no hash"


def test_images_run_the_torch_the_tests_run():
    torch = torch_version_under_test()
    assert read_lock("cpu-torch.lock")["torch"][0] == f"{torch}+cpu" and list(read_lock("cpu-torch.lock")) == ["torch"]
    assert "torch" not in read_lock("cpu.lock")  # only PyTorch's index serves it, and only it
    assert read_lock("gpu.lock")["torch"][0] == torch
    assert "ucxx-cu13" in read_lock("gpu.lock") and "ucxx-cu12" not in read_lock("gpu.lock")  # torch's CUDA 13


def test_build_tools_and_flash_attn_are_locked():
    assert set(read_lock("build.lock")) >= {"ninja", "packaging", "psutil", "setuptools", "wheel"}
    assert list(read_lock("flash-attn.lock")) == ["flash-attn"]
    assert "flash-attn" not in read_lock("gpu.lock")  # built in the builder stage, not fetched prebuilt
