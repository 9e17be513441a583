"""A GGUF file's own quantized blocks, kept through conversion so ``--quantization int4`` serves
them as the file stores them instead of quantizing its dequantized weights a second time.

GGUF's 4-bit types map exactly onto the int4 kernel's groups of 32 inputs, whose weight is
``(q - 8) * scale + zero`` (``common.engine.models.quantized.Int4Weight``)::

    type   block                                   weight of a block's 32 (Q4_K: 8 x 32) values
    Q4_0   fp16 d, 32 nibbles                      d * (q - 8)         -> scale d,      zero 0
    Q4_1   fp16 d, fp16 m, 32 nibbles              d * q + m           -> scale d,      zero m + 8 d
    Q4_K   fp16 d, dmin; 8 x 6-bit (sc, m); 256    d*sc * q - dmin*m   -> scale d*sc,   zero 8 d*sc - dmin*m
           nibbles

(the kernel reads scale and zero in bf16: that rounding is the only difference).  Wider types
(Q5_*, Q6_K, Q8_0, ...) have no int4 form that keeps what they hold, and the int8 kernel keeps one
scale per output channel where they keep one per 16 or 32 inputs: under int4 such a weight is
quantized to int8 per channel from its dequantized values, under int8 every weight is; the load
says so in one log line (``SourceWeights.summary``).

A converted directory (``common.engine.loading.default_model``) holds the blocks of every 4-bit
weight in ``BLOCKS_FILE`` (``<hf name>.q4``, ``.q4_scale``, ``.q4_zero``, rows in the
checkpoint's order) and each weight's GGUF type in ``gguf_source.json`` (``tensor_types``).
"""
from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

# In a folder of its own: tools that take every top-level *.safetensors of a checkpoint for its
# weights (vLLM, transformers' sharded loading) must not meet it.
BLOCKS_FILE = "gguf_blocks/blocks.safetensors"
GROUP_SIZE = 32  # inputs per group of every 4-bit type (Q4_K: 8 sub-blocks of 32)
FOUR_BIT_TYPES = ("Q4_0", "Q4_1", "Q4_K")  # GGML type names; gguf is imported only to convert
UNQUANTIZED_TYPES = ("F32", "F16", "BF16", "F64")
_PARTS = (".q4", ".q4_scale", ".q4_zero")


def four_bit_groups(blocks: np.ndarray, tensor_type, shape: tuple[int, ...]):
    """``(q, scale, zero)`` of a 4-bit tensor's block bytes (``tensor_type`` a gguf
    ``GGMLQuantizationType`` of ``FOUR_BIT_TYPES``), ``shape`` in torch order (rows, inputs): ``q``
    uint8 ``[rows, inputs]``, ``scale``/``zero`` fp32 ``[rows, inputs / 32]``."""
    from gguf.constants import GGML_QUANT_SIZES
    from gguf.quants import Q4_K

    rows, inputs = int(np.prod(shape[:-1])), shape[-1]
    raw = np.ascontiguousarray(blocks).view(np.uint8).reshape(-1, GGML_QUANT_SIZES[tensor_type][1])
    n = raw.shape[0]
    kind = tensor_type.name
    d = raw[:, 0:2].view(np.float16).astype(np.float32)  # every 4-bit block starts with its fp16 scale
    if kind == "Q4_K":
        dmin = raw[:, 2:4].view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(raw[:, 4:16])
        scale = d * sc.astype(np.float32)  # [n, 8]
        zero = 8.0 * scale - dmin * m.astype(np.float32)
        qs = raw[:, 16:].reshape(n, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        q = (qs & 0x0F).reshape(n, 256)  # 32 bytes hold sub-block 2c (low nibbles) and 2c+1 (high)
    else:
        if kind == "Q4_0":
            scale, zero, qs = d, np.zeros_like(d), raw[:, 2:]
        elif kind == "Q4_1":
            scale, zero, qs = d, raw[:, 2:4].view(np.float16).astype(np.float32) + 8.0 * d, raw[:, 4:]
        else:
            raise ValueError(f"{kind} is not a 4-bit type")
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1)  # elements 0..15 low nibbles, 16..31 high
    groups = inputs // GROUP_SIZE
    return (q.reshape(rows, inputs), scale.reshape(rows, groups).astype(np.float32),
            zero.reshape(rows, groups).astype(np.float32))


def blocks_state(name: str, q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> dict[str, torch.Tensor]:
    """The entries of ``BLOCKS_FILE`` for weight ``name``."""
    return {name + part: torch.from_numpy(np.ascontiguousarray(a)) for part, a in zip(_PARTS, (q, scale, zero))}


class SourceWeights:
    """How a converted GGUF stored each weight, and the 4-bit ones' blocks.  Asked per product
    (names: the checkpoint weights fused into it), it says which form the product takes."""

    group_size = GROUP_SIZE

    def __init__(self, tensor_types: dict[str, str], blocks: dict[str, torch.Tensor]):
        self.tensor_types = tensor_types
        self.blocks = blocks
        self.decisions: Counter[str] = Counter()

    @classmethod
    def of_checkpoint(cls, checkpoint: Path) -> "SourceWeights | None":
        """The source of a converted GGUF directory; None for any other checkpoint."""
        try:
            types = json.loads((checkpoint / "gguf_source.json").read_text()).get("tensor_types")
        except (OSError, ValueError):
            return None
        if not isinstance(types, dict):
            return None
        blocks: dict[str, torch.Tensor] = {}
        if (checkpoint / BLOCKS_FILE).is_file():
            from safetensors.torch import load_file
            blocks = load_file(str(checkpoint / BLOCKS_FILE))
        return cls(types, blocks)

    def int4_groups(self, names: list[str]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The file's 4-bit groups (``GROUP_SIZE`` inputs) of ``names``' weights, stacked by rows
        (a fused product): ``(q, scale, zero)``, or None unless every one of them has its groups."""
        if not all(name + _PARTS[0] in self.blocks for name in names):
            return None
        self.decisions["4-bit blocks kept"] += 1
        q, scale, zero = (torch.cat([self.blocks[name + part] for name in names]) for part in _PARTS)
        return q, scale, zero

    def holds_more_than_four_bits(self, names: list[str]) -> bool:
        """Whether any of ``names`` is stored in a quantized type wider than 4 bits (Q5_0, Q6_K,
        Q8_0, ...): int4 would lose what the file keeps."""
        wider = [self.tensor_types.get(name) for name in names]
        if any(t is not None and t not in UNQUANTIZED_TYPES and t not in FOUR_BIT_TYPES for t in wider):
            self.decisions["wider blocks to int8 per channel"] += 1
            return True
        return False

    def summary(self, scheme: str) -> str:
        kinds = Counter(self.tensor_types.values())
        counts = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items()))
        if scheme != "int4":
            return (f"quantization {scheme}: the GGUF's weights ({counts}) were dequantized at conversion and are "
                    f"quantized again per channel here (its blocks keep one scale per 16-32 inputs)")
        kept = self.decisions["4-bit blocks kept"]
        wider = self.decisions["wider blocks to int8 per channel"]
        return (f"quantization int4 on a GGUF ({counts}): {kept} products keep the file's 4-bit blocks exactly; "
                f"{wider} hold wider blocks and are quantized to int8 per channel from their dequantized "
                f"values (no exact int4 form); the rest are quantized to int4 groups")
