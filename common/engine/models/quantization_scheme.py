"""Which quantization a model uses (``--quantization``, ``--quantization-group-size``);
declared without torch so configurations and tools can read it (the products: ``quantized``)."""
from __future__ import annotations

from dataclasses import dataclass

QUANTIZATIONS = ("none", "int8", "int4", "fp8")
INT4_GROUP_SIZES = (32, 64, 128)


@dataclass(frozen=True)
class Quantization:
    """How a model's weights are stored: ``scheme`` one of ``QUANTIZATIONS``; ``group_size`` the
    inputs per int4 group."""

    scheme: str = "none"
    group_size: int = 32  # the smallest: on Gemma 3 270M, 128 costs +75% perplexity, 32 +20% (quant_quality.py)

    def __post_init__(self) -> None:
        if self.scheme not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.scheme!r}")
        if self.group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"quantization group size must be one of {INT4_GROUP_SIZES}, got {self.group_size}")

    @property
    def enabled(self) -> bool:
        return self.scheme != "none"


NO_QUANTIZATION = Quantization()
