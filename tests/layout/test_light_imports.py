"""The command-line tools and the configurations load without torch: ``pdctl`` runs on an
operator's laptop and in scripts (each run would pay seconds importing it), the launcher and the
worker's flags are read before any model.  Imported in a fresh interpreter, as a user runs them."""
from __future__ import annotations

import subprocess
import sys

LIGHT_MODULES = ("pdctl.cli", "launcher.__main__", "worker.config", "common.engine.config", "kvtransfer",
                 "kvtransfer.config", "common.engine.loading.checkpoint_path")


def test_tools_and_configurations_import_without_torch():
    probe = ("import importlib, sys\n"
             f"for name in {LIGHT_MODULES!r}:\n"
             "    importlib.import_module(name)\n"
             "heavy = sorted(m for m in ('torch', 'transformers', 'safetensors.torch') if m in sys.modules)\n"
             "print(','.join(heavy))\n")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"loaded {result.stdout.strip()}"


def test_the_kvtransfer_package_still_exports_its_names():
    import kvtransfer

    for name in kvtransfer.__all__:
        assert getattr(kvtransfer, name) is not None
