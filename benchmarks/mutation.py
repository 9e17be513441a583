"""Mutation score of the modules that hold the system's invariants, against the tests that cover them.

mutmut (3.x) changes one operator, constant or call at a time in each module below and runs the
tests that cover the changed function (it finds them by tracing the tests once).  A mutant is
*killed* when a test fails or times out, *survives* when every test still passes, and has *no
tests* when none reaches the changed function (counted with the survivors: nothing would notice).
Some survivors cannot be killed because they do not change behaviour (a default nobody passes, a
log message, an assert message); each of those is listed in ``mutation_equivalents.json`` beside
this file, with the reason, keyed by module, function and the changed lines (not by mutmut's
number, which shifts when the file changes).  The kill rate counts only the others::

    kill_rate = killed / (killed + survived + no_tests)         (equivalent mutants left out)

The run happens in a copy of the checkout (tracked and untracked, not ignored, files), so the
working tree is never touched.  Not part of ``make test``: a full run takes tens of minutes on two
cores.

    python benchmarks/mutation.py                # every mutant of every module
    python benchmarks/mutation.py --quick        # a deterministic sample (every 5th mutant)
    python benchmarks/mutation.py --module gateway/backpressure.py --survivors

The last line of stdout is one JSON object: ``{"kill_rate": ..., "modules": {path: {"killed",
"survived", "equivalent", "no_tests", "timeout"}}, ...}``; with ``--survivors`` each surviving
mutant's diff is printed before it.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.bench_util import emit  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
EQUIVALENTS_FILE = Path(__file__).with_name("mutation_equivalents.json")

# Each module, and the test files that exercise it in-process (mutmut traces which test reaches
# which function; tests that only drive the module inside another process cannot be traced).
SCHEDULER_TESTS = ["tests/engine/test_scheduler.py", "tests/engine/test_scheduler_liveness.py",
                   "tests/engine/test_scheduler_livelock.py", "tests/engine/test_scheduler_progress.py",
                   "tests/worker/test_lease_after_landing.py"]
KV_TESTS = ["tests/kvtransfer", "tests/worker/test_decode_peer_faults.py", "tests/worker/test_prefill_shipping_order.py"]
AUTH_TESTS = ["tests/cluster/test_auth.py", "tests/cluster/test_replay_cache.py", "tests/worker/test_worker_auth.py",
              "tests/worker/test_signed_body.py", "tests/cluster/test_registry_signing.py"]
MODULES: dict[str, list[str]] = {
    "common/engine/scheduler.py": SCHEDULER_TESTS,
    "common/engine/room_alone.py": ["tests/engine/test_room_alone.py", *SCHEDULER_TESTS],  # the scheduler's room computation
    "common/engine/kv/kv_cache_manager.py": [*SCHEDULER_TESTS, "tests/gateway/test_prefix_lookup.py",
                                             "tests/engine/test_block_table.py"],
    "common/engine/kv/block_pool.py": ["tests/engine/test_block_pool.py", "tests/gateway/test_prefix_lookup.py", *SCHEDULER_TESTS],
    "common/engine/kv/block_table.py": ["tests/engine/test_block_table.py", *SCHEDULER_TESTS],
    "kvtransfer/receiver.py": KV_TESTS,
    "kvtransfer/sender.py": KV_TESTS,
    "gateway/backpressure.py": ["tests/gateway/test_backpressure.py", "tests/gateway/test_backpressure_machine.py"],
    "common/cluster/auth.py": AUTH_TESTS,
    "common/cluster/nonce_cache.py": AUTH_TESTS,  # auth's replay cache, moved out of it
}

# mutmut's exit codes (mutmut.stats.status_by_exit_code) as the categories reported here.
STATUS_BY_EXIT_CODE = {0: "survived", 1: "killed", 3: "killed", 33: "no_tests", 34: "skipped", 35: "suspicious",
                       36: "timeout", -24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout"}


def copy_checkout(destination: Path) -> None:
    """Copy the files git knows (tracked, and untracked ones not ignored) into ``destination``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            target = destination / name
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def configure(workdir: Path, modules: dict[str, list[str]]) -> None:
    """Append mutmut's settings to the copy's pyproject.toml."""
    tests = sorted({test for paths in modules.values() for test in paths})
    packages = sorted({module.split("/")[0] for module in modules})
    settings = {
        "source_paths": packages,
        "only_mutate": sorted(modules),
        "also_copy": ["benchmarks", "decode_svc", "prefill_svc", "common", "gateway", "kvtransfer", "worker", "launcher",
                      "pdctl"],
        "pytest_add_cli_args_test_selection": tests,
        "pytest_add_cli_args": ["-p", "no:cacheprovider", "-q", "-x"],
        "timeout_multiplier": 10.0,
    }
    lines = ["", "[tool.mutmut]"] + [f"{key} = {json.dumps(value)}" for key, value in settings.items()]
    with open(workdir / "pyproject.toml", "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def mutmut(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(workdir), "PYTHONDONTWRITEBYTECODE": "1"}
    done = subprocess.run([sys.executable, "-m", "mutmut", *args], cwd=workdir, env=env, capture_output=True,
                          text=True)
    if check and done.returncode:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"mutmut {' '.join(args[:2])} failed with status {done.returncode}")
    return done


def mutant_names(workdir: Path) -> list[str]:
    """Every mutant of the run, from mutmut's result listing (generated but not yet run)."""
    out = mutmut(workdir, "results", "--all", "true").stdout
    return [line.split(":")[0].strip() for line in out.splitlines() if "__mutmut_" in line]


def exit_codes(workdir: Path, module: str) -> dict[str, int | None]:
    meta = json.loads((workdir / "mutants" / f"{module}.meta").read_text())
    return meta["exit_code_by_key"]


def diff_of(workdir: Path, name: str) -> str:
    out = mutmut(workdir, "show", name, check=False).stdout
    return "\n".join(line for line in out.splitlines() if not line.startswith("#"))


def equivalence_key(module: str, name: str, diff: str) -> str:
    """A key that survives renumbering: the module, the function, and the changed lines."""
    function = re.sub(r"__mutmut_\d+$", "", name.rsplit(".", 1)[-1]).replace("ǁ", ".").strip(".")
    function = re.sub(r"^x_?\.?", "", function)
    changed = [line[1:].strip() for line in diff.splitlines()
               if line[:1] in "+-" and not line.startswith(("+++", "---"))]
    digest = hashlib.sha256("\n".join(changed).encode()).hexdigest()[:12]
    return f"{module}:{function}:{digest}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="run every 5th mutant of each module only")
    parser.add_argument("--module", action="append", help="only this module (repeatable); default: all of them")
    parser.add_argument("--survivors", action="store_true", help="print each surviving mutant's diff and key")
    parser.add_argument("--keep", help="run in this folder and keep it (default: a temporary one)")
    parser.add_argument("--max-children", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    modules = {m: tests for m, tests in MODULES.items() if not args.module or m in args.module}
    unknown = set(args.module or ()) - set(MODULES)
    if unknown:
        parser.error(f"not a module of this benchmark: {sorted(unknown)}; choose from {sorted(MODULES)}")
    equivalents: dict[str, str] = json.loads(EQUIVALENTS_FILE.read_text()) if EQUIVALENTS_FILE.exists() else {}

    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="pdserve-mutation-"))
    if args.keep and workdir.exists():
        shutil.rmtree(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    try:
        copy_checkout(workdir)
        configure(workdir, modules)
        selected: list[str] = []
        if args.quick:
            # Generate the mutants (and trace the tests) without running them, then pick a sample.
            mutmut(workdir, "run", "nothing-matches-this-name", check=False)  # generates, then finds none
            selected = mutant_names(workdir)[::5]
        mutmut(workdir, "run", "--max-children", str(args.max_children), *selected)
        report: dict[str, dict[str, int]] = {}
        totals = {"killed": 0, "survived": 0, "no_tests": 0, "equivalent": 0}
        for module in modules:
            counts = {"killed": 0, "survived": 0, "equivalent": 0, "no_tests": 0, "timeout": 0}
            for name, code in sorted(exit_codes(workdir, module).items()):
                if selected and name not in selected or code is None:
                    continue
                status = STATUS_BY_EXIT_CODE.get(code, "killed" if code else "survived")
                if status in ("survived", "no_tests"):
                    diff = diff_of(workdir, name)
                    key = equivalence_key(module, name, diff)
                    if key in equivalents:
                        status = "equivalent"
                    elif args.survivors:
                        print(f"# {status}: {name}\n# key: {key}\n{diff}\n")
                if status == "timeout":
                    counts["timeout"] += 1
                    status = "killed"  # the tests noticed: they did not finish
                if status in counts:
                    counts[status] += 1
                    totals[status] += 1 if status in totals else 0
            report[module] = counts
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    countable = totals["killed"] + totals["survived"] + totals["no_tests"]
    emit({
        "benchmark": "mutation",
        "quick": args.quick,
        "kill_rate": round(totals["killed"] / countable, 4) if countable else None,
        "killed": totals["killed"],
        "survived": totals["survived"],
        "no_tests": totals["no_tests"],
        "equivalent": totals["equivalent"],
        "modules": report,
        "seconds": round(time.monotonic() - began, 1),
    })


if __name__ == "__main__":
    main()
