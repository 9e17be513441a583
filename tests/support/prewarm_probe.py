"""A ``python -m`` target for tests/launcher/test_prewarmed.py: reports how it was started, then
does what its second argument says (``exit N``, ``raise``, ``sleep``, ``helper``: start a helper
in its process group, report its pid, then exit)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

torch_was_imported = "torch" in sys.modules  # before this module imports anything heavy


def main() -> None:
    report_path, action = sys.argv[1], sys.argv[2]
    import torch

    report = {"argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "pid": os.getpid(), "pgid": os.getpgid(0),
              "sid": os.getsid(0), "probe_var": os.environ.get("PROBE_VAR"), "stray": os.environ.get("PROBE_STRAY"),
              "threads": torch.get_num_threads(), "torch_preloaded": torch_was_imported,
              "affinity": sorted(os.sched_getaffinity(0))}
    print("to stdout", flush=True)
    print("to stderr", file=sys.stderr, flush=True)
    if action == "helper":
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        report["helper"] = helper.pid
    with open(report_path + ".tmp", "w") as out:
        json.dump(report, out)
    os.replace(report_path + ".tmp", report_path)
    if action == "sleep":
        time.sleep(600)
    elif action == "raise":
        raise RuntimeError("the probe was told to fail")
    elif action.startswith("exit"):
        sys.exit(int(action.split()[1]))


if __name__ == "__main__":
    main()
