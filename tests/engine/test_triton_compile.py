"""The Triton kernels compiled for sm_90 (H100/H200), on CPU: no GPU needed (ptxas comes with the
triton wheel). The interpreter (tests/engine/test_attention_triton.py) runs the kernels as Python and cannot
see what only the compiler rejects: types of loop-carried values, shapes ``tl.dot`` refuses,
shared memory. A subprocess, because Triton decides at import whether it interprets."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow(seconds=10)  # a long file: scheduled by its length (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[2]

COMPILE = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from common.engine.attention import backend_triton as at

attention, write = at._kernels()
launches = []
for max_query_len in (1, 512):  # Llama-3-8B heads in bf16: a decode launch and a prefill launch
    block_m, block_q, tile = at.launch_config(4, 128, max_query_len)
    launches.append((attention, {"q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
                                 "out_ptr": "*bf16", "block_table_ptr": "*i32", "seq_lens_ptr": "*i32",
                                 "query_start_ptr": "*i32", "scale": "fp32"},
                     dict(QUERIES_PER_KV=4, HEAD_DIM=128, HEAD_DIM_P=128, BLOCK_SIZE=16, BLOCK_Q=block_q,
                          BLOCK_M=block_m, TILE=tile, SLIDING=max_query_len > 1, DOT_PRECISION="tf32")))
launches.append((write, {"k_ptr": "*bf16", "v_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
                         "slots_ptr": "*i64"},
                 dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEAD_DIM_P=128, HEADS_P=8, BLOCK_SIZE=16)))
for kernel, pointers, constexprs in launches:
    signature = {name: "constexpr" if name in constexprs else pointers.get(name, "i32") for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs),
                              target=GPUTarget("cuda", 90, 32))
    assert compiled.asm["cubin"], kernel
    print("compiled", kernel.__name__, constexprs, "shared", compiled.metadata.shared)
"""


def test_kernels_compile_for_hopper(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(tmp_path)}
    env.pop("TRITON_INTERPRET", None)
    proc = subprocess.run([sys.executable, "-c", COMPILE], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("compiled") == 3
