"""A tiny stand-in for a stack process, for the launcher's process tests (no model, starts in ms).

    python tests/support/launcher_child.py DIR NAME MODE [--grandchild] [--fifo PATH]

Writes ``DIR/NAME.ready`` once its SIGTERM handler is installed, ``DIR/NAME.term`` (the time) when
SIGTERM arrives, and then, by MODE:

    drain   waits until ``DIR/release`` exists (a drain the test controls), writes
            ``DIR/NAME.drained`` and exits 0
    stuck   ignores SIGTERM: only SIGKILL ends it

``--grandchild`` starts a ``sleep`` of its own first (in its process group) and writes its pid to
``DIR/NAME.grandchild``.  ``--fifo PATH`` opens the FIFO PATH for writing, so the test's reader
sees end-of-file the moment this process dies.  Files are written whole (write, then rename).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def main() -> None:
    directory, name, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    options = sys.argv[4:]
    if mode not in ("drain", "stuck"):
        raise SystemExit(f"unknown mode {mode!r}")
    if "--fifo" in options:
        fifo = os.open(options[options.index("--fifo") + 1], os.O_WRONLY)  # noqa: F841 (held until death)
    terminated = False

    def on_term(_sig, _frame) -> None:
        nonlocal terminated
        if not terminated:
            write(directory / f"{name}.term", repr(time.time()))
        terminated = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # only the launcher decides when this stops
    if "--grandchild" in options:
        helper = subprocess.Popen(["sleep", "600"])
        write(directory / f"{name}.grandchild", str(helper.pid))
    write(directory / f"{name}.ready", str(os.getpid()))
    while True:
        if terminated and mode == "drain" and (directory / "release").exists():
            write(directory / f"{name}.drained", repr(time.time()))
            sys.exit(0)
        time.sleep(0.02)


if __name__ == "__main__":
    main()
