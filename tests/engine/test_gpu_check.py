"""benchmarks/gpu_check.py on CPU, as the GPU machine runs it: a subprocess without msgspec, redis,
ucxx or gguf (the GPU environment has none of them), its result read from the JSON last line.

``--cpu-interpret`` is step 1 (the Triton kernels under Triton's interpreter against the torch
path, fp32); ``--smoke`` runs steps 2-4 on tiny shapes, so the code the GPU runs once has run here.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow(seconds=30)  # a long file: scheduled by its length (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]
ABSENT = ("msgspec", "redis", "ucxx", "gguf")
RUN_WITHOUT = f"""
import runpy, sys
for name in {ABSENT!r}:
    sys.modules[name] = None  # 'import name' fails as if it were not installed
sys.argv = ["gpu_check.py"] + sys.argv[1:]
runpy.run_path({str(ROOT / "benchmarks" / "gpu_check.py")!r}, run_name="__main__")
"""


def gpu_check(*args: str, tmp_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)  # --cpu-interpret must set it itself
    proc = subprocess.run([sys.executable, "-c", RUN_WITHOUT, *args, "--workdir", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cpu_interpret_runs_every_attention_case_within_tolerance(tmp_path):
    result = gpu_check("--cpu-interpret", tmp_path=tmp_path)
    assert result["mode"] == "cpu-interpret" and result["errors"] == {}, result["errors"]
    errors = result["attention_errors"]
    assert result["attention_cases"] == len(errors) >= 6
    for case in ("prefill_chunks", "decodes", "mixed", "sliding_window", "gqa_8_to_1", "block_size_256"):
        assert f"triton/{case}" in errors
    assert all(err < 1e-3 for err in errors.values()), errors
    assert result["attention_max_abs_err"] < 1e-3
    assert result["attention_ok"] and result["ok"]


def test_smoke_runs_parity_speed_and_chunked_prefill_steps(tmp_path):
    result = gpu_check("--smoke", "--steps", "parity,speed,chunked", tmp_path=tmp_path)
    assert result["errors"] == {}, result["errors"]
    assert result["greedy_parity"] is True
    assert set(result["decode_step_ms"]) == {"1", "4"} and all(ms > 0 for ms in result["decode_step_ms"].values())
    assert result["decode_roofline_ms"] >= 0 and result["prefill_tokens_per_step"] == 64
    assert result["itl_p99_ratio_unchunked_over_chunked"] > 0


def test_a_step_past_the_time_limit_is_reported_and_the_json_still_comes_out(tmp_path):
    """The GPU is lent for minutes: a slow step must not cost the whole report."""
    result = gpu_check("--smoke", "--steps", "parity,speed", "--time-limit", "0.5", tmp_path=tmp_path)
    assert set(result["errors"]) == {"parity", "speed"} and not result["ok"]
    assert "OutOfTime" in result["errors"]["parity"] or "skipped" in result["errors"]["parity"]
    assert "skipped" in result["errors"]["speed"]
