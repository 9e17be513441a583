#!/usr/bin/env bash
# Regenerate the lock files the images install with `pip install --require-hashes` (run
# `make lock` after changing a dependency in pyproject.toml; needs `uv` on PATH, or UV=...).
#
#   cpu.lock          CPU image: Python 3.11, extra `ucx`, everything from PyPI ...
#   cpu-torch.lock    ... but torch 2.13.0+cpu, which only PyTorch's CPU index has (installed from there alone)
#   gpu.lock          GPU image: Python 3.12 (Ubuntu 24.04), torch 2.13.0 (CUDA 13, PyPI), extra `gpu`
#                     without flash-attn, which the image builds from source in its builder stage:
#   flash-attn.lock   flash-attn's source archive, pinned by hash
#   build.lock        what building flash-attn needs (ninja, packaging, psutil, setuptools, wheel)
#
# torch is pinned to the version `make test` installs (Makefile), so images run what the tests ran;
# tests/deploy/test_lock.py checks that and that every pyproject dependency is pinned, with hashes.
set -euo pipefail
cd "$(dirname "$0")/.."
UV=${UV:-uv}
TORCH=$(sed -n 's/.*pip install -q torch==\([0-9.]*\).*/\1/p' Makefile)
FLASH_ATTN=2.8.3
PLATFORM=x86_64-manylinux_2_28
common=(--generate-hashes --no-header --index-url https://pypi.org/simple --python-platform "$PLATFORM")
tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT

# flash-attn's metadata needs a CUDA build to compute: state it here instead of building it.
cat > "$tmp/uv.toml" <<TOML
[[dependency-metadata]]
name = "flash-attn"
version = "$FLASH_ATTN"
requires-dist = ["torch", "einops"]
TOML

# CPU: the CPU build of torch is on PyTorch's own index (TORCH_CPU_INDEX= with PIP_FIND_LINKS
# pointing at a local copy of the same wheel works offline).
TORCH_CPU_INDEX=${TORCH_CPU_INDEX-https://download.pytorch.org/whl/cpu}
echo "torch==$TORCH+cpu" > "$tmp/cpu.in"
"$UV" pip compile pyproject.toml "$tmp/cpu.in" --extra ucx --python-version 3.11 "${common[@]}" \
    ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} ${TORCH_CPU_INDEX:+--extra-index-url "$TORCH_CPU_INDEX"} \
    --index-strategy unsafe-best-match --no-annotate -o requirements/cpu.lock
# Move torch's entry to its own file: the image installs it from PyTorch's index only, so no other
# package is ever taken from there.
python3 - <<'PY'
from pathlib import Path
lock = Path("requirements/cpu.lock")
lines = lock.read_text().splitlines(keepends=True)
start = next(i for i, line in enumerate(lines) if line.startswith("torch=="))
end = start + 1
while end < len(lines) and lines[end].startswith(" "):
    end += 1
Path("requirements/cpu-torch.lock").write_text("".join(lines[start:end]))
lock.write_text("".join(lines[:start] + lines[end:]))
PY

echo "torch==$TORCH" > "$tmp/gpu.in"
echo "flash-attn==$FLASH_ATTN" >> "$tmp/gpu.in"
"$UV" pip compile --config-file "$tmp/uv.toml" pyproject.toml "$tmp/gpu.in" --extra gpu --python-version 3.12 \
    "${common[@]}" --no-emit-package flash-attn --no-annotate -o requirements/gpu.lock

echo "flash-attn==$FLASH_ATTN" > "$tmp/flash.in"
"$UV" pip compile --config-file "$tmp/uv.toml" "$tmp/flash.in" --no-deps --python-version 3.12 "${common[@]}" \
    --no-annotate -o requirements/flash-attn.lock

printf 'ninja\npackaging\npsutil\nsetuptools\nwheel\n' > "$tmp/build.in"
"$UV" pip compile "$tmp/build.in" --python-version 3.12 "${common[@]}" --no-annotate -o requirements/build.lock
