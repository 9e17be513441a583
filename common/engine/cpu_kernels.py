"""Small C kernels for the CPU path (``common/engine/csrc/<name>.c``), compiled once per machine.

Each kernel is built with the system C compiler (``cc``; OpenMP when it has it, else
single-threaded) into ``<cache>/kernels/<name>-<digest>.so``, where the digest covers the source,
every header in ``csrc/`` (a kernel's own and the shared ones, such as ``vec16.h``) and the CPU's
flags (``-march=native``: a build is only valid on a CPU with the same features, say on a shared
cache volume), and loaded with ctypes; ctypes calls release the GIL.
``load_kernel`` returns ``None``, and says why in the log, where there is no compiler: callers
keep a pure-torch path.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

log = logging.getLogger(__name__)

SOURCES = Path(__file__).with_name("csrc")
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def cache_dir() -> Path:
    from common.engine.loading.default_model import default_cache_dir

    return default_cache_dir() / "kernels"


def compile_source(source: Path, target: Path, march: str = "native") -> None:
    """``source`` built into the shared library ``target`` for CPUs of ``march`` (``-march=``: tests
    build a kernel's AVX2 code on CPUs that have more)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    base = [cc, "-O3", f"-march={march}", "-ffp-contract=fast", "-fPIC", "-shared", str(source)]
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        try:
            subprocess.run([*base, "-fopenmp", "-o", str(out), "-lm"], check=True, capture_output=True, timeout=300)
        except subprocess.CalledProcessError:  # no OpenMP: single-threaded kernel
            subprocess.run([*base, "-o", str(out), "-lm"], check=True, capture_output=True, timeout=300)
        os.replace(out, target)  # atomic: concurrent builders each install a complete file


def load_kernel(name: str) -> ctypes.CDLL | None:
    """The compiled ``csrc/<name>.c`` (built on first use, then reused from the cache), or ``None``."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        source = SOURCES / f"{name}.c"
        try:
            headers = b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))  # its own and shared includes
            digest = hashlib.sha256(source.read_bytes() + headers + _cpu_signature()).hexdigest()[:16]
            target = cache_dir() / f"{name}-{digest}.so"
            if not target.exists():
                compile_source(source, target)
            lib = ctypes.CDLL(str(target))
        except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning("CPU kernel %s unavailable (%s %s); using the torch path", name, exc,
                        detail.decode(errors="replace")[:500])
            lib = None
        _loaded[name] = lib
        return lib


def kernel_function(name: str, symbol: str, argtypes: list, restype=None, cpu_specific: bool = False):
    """Function ``symbol`` of the compiled ``csrc/<name>.c`` with its C signature set, or ``None``
    where the kernel cannot be built (``load_kernel``) -- or, for a ``cpu_specific`` entry (one the
    source defines only where the CPU has some extension), where this build does not have it."""
    lib = load_kernel(name)
    if lib is None or (cpu_specific and not hasattr(lib, symbol)):
        return None
    fn = getattr(lib, symbol)
    if fn.argtypes is None:
        fn.argtypes = argtypes
        fn.restype = restype
    return fn


def _cpu_signature() -> bytes:
    flags = b""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            flags = next((line for line in f if line.startswith(b"flags")), b"")
    except OSError:
        pass
    return os.uname().machine.encode() + flags


def profiled(label: str) -> contextlib.AbstractContextManager:
    """A range named ``label`` for torch's profiler around a kernel call (ctypes calls are invisible
    to it) -- while a profiler runs only: entering a range costs ~10 us, ~1 ms of a batch-1 decode
    step's ~90 kernel calls."""
    import torch

    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(label)
    return contextlib.nullcontext()
