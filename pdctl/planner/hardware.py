"""What the planner knows about hardware and models: GPU and link profiles, model sizes.

GPU figures are the vendors' dense (no sparsity) bf16 tensor-core peaks and HBM bandwidths; a
profile never reaches them, so the roofline cost model multiplies them by efficiency factors
(``mfu`` for compute, ``mbu`` for memory bandwidth).  Link figures are per direction.

A ``ModelSpec`` holds the handful of numbers a roofline needs (FLOPs and bytes per token, KV bytes
per token), read from a Hugging Face ``config.json`` or taken from the built-in table, which lets
``pdctl plan --model llama-3-8b`` run on a machine that has no checkpoint.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

GB = 1e9
TERA = 1e12


@dataclass(frozen=True)
class GPUProfile:
    """One accelerator: dense bf16 FLOP/s, HBM bytes/s and memory, plus typical efficiencies."""

    name: str
    bf16_flops: float
    hbm_bandwidth: float  # bytes/s
    memory_bytes: float
    mfu: float = 0.5  # fraction of peak FLOP/s a large prefill reaches
    mbu: float = 0.7  # fraction of peak bandwidth a decode step reaches
    step_overhead_s: float = 0.0015  # scheduling, launches, sampling: paid once per step
    default_link: str = "nvlink4"

    def with_efficiency(self, efficiency: float | None) -> "GPUProfile":
        """The same GPU with both efficiencies set to ``efficiency`` (None: keep the defaults)."""
        if efficiency is None:
            return self
        if not 0 < efficiency <= 1:
            raise ValueError(f"efficiency must be in (0, 1], got {efficiency}")
        return replace(self, mfu=efficiency, mbu=efficiency)


GPUS: dict[str, GPUProfile] = {
    "H100": GPUProfile("H100", 989 * TERA, 3.35e12, 80 * GB),
    "H200": GPUProfile("H200", 989 * TERA, 4.8e12, 141 * GB),
    "A100": GPUProfile("A100", 312 * TERA, 2.039e12, 80 * GB, default_link="nvlink3"),
    "L40S": GPUProfile("L40S", 362 * TERA, 0.864e12, 48 * GB, default_link="pcie4"),
}


@dataclass(frozen=True)
class LinkProfile:
    """A KV-transfer path between a prefill and a decode GPU: bytes/s per direction, per-batch latency."""

    name: str
    bandwidth: float  # bytes/s, one direction, after protocol overhead
    latency_s: float
    source: str = "spec"


LINKS: dict[str, LinkProfile] = {
    "nvlink4": LinkProfile("nvlink4", 450 * GB * 0.8, 10e-6),  # H100/H200 NVLink: 900 GB/s both ways
    "nvlink3": LinkProfile("nvlink3", 300 * GB * 0.8, 10e-6),  # A100
    "ib-ndr": LinkProfile("ib-ndr", 50 * GB * 0.9, 20e-6),  # InfiniBand NDR, 400 Gb/s per GPU
    "ib-hdr": LinkProfile("ib-hdr", 25 * GB * 0.9, 20e-6),  # InfiniBand HDR / RoCE 200 Gb/s
    "pcie4": LinkProfile("pcie4", 25 * GB * 0.8, 20e-6),
    "pcie5": LinkProfile("pcie5", 50 * GB * 0.8, 20e-6),
}


def measured_link(path: Path, transport: str = "ucx") -> LinkProfile:
    """The KV bandwidth that ``benchmarks/kv_transfer.py`` measured (its JSON last line, saved to a file)."""
    try:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()]
        result = json.loads(lines[-1])
    except (OSError, ValueError, IndexError) as exc:
        raise ValueError(f"cannot read a kv_transfer result from {str(path)!r}: {exc}") from None
    key = f"{transport}_gbps"
    if not isinstance(result, dict) or not isinstance(result.get(key), (int, float)) or result[key] <= 0:
        raise ValueError(f"{str(path)!r} has no positive {key!r} (run benchmarks/kv_transfer.py > FILE)")
    return LinkProfile(f"{transport}-measured", float(result[key]) * GB, 100e-6, source=str(path))


def parse_link(text: str) -> LinkProfile:
    """A link by name (``nvlink4``, ``ib-ndr``, ...), ``GBPS`` as a number, or ``ucx:FILE``/``tcp:FILE``
    with a ``benchmarks/kv_transfer.py`` result."""
    if text in LINKS:
        return LINKS[text]
    transport, _, path = text.partition(":")
    if transport in ("ucx", "tcp") and path:
        return measured_link(Path(path), transport)
    try:
        gbps = float(text)
    except ValueError:
        raise ValueError(f"link {text!r}: expected one of {sorted(LINKS)}, a bandwidth in GB/s, "
                         "or ucx:FILE / tcp:FILE (a benchmarks/kv_transfer.py result)") from None
    if not gbps > 0:
        raise ValueError(f"link bandwidth must be > 0 GB/s, got {text}")
    return LinkProfile(f"{gbps:g}GB/s", gbps * GB, 20e-6)


# Bytes a value of each --kv-cache-dtype but auto (common/engine/kv/kv_cache.py's torch dtypes'; a test holds
# them equal) -- the planner does not import torch.
KV_CACHE_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}


@dataclass(frozen=True)
class ModelSpec:
    """The model facts a cost model needs (``rank_*``: one rank's share under tensor parallelism,
    split as ``common/engine/parallel/tensor_parallel.py`` splits the model)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool = False
    max_model_len: int = 8192
    dtype_bytes: int = 2
    kv_dtype_bytes: int | None = None  # the KV cache's bytes a value (--kv-cache-dtype); None: dtype_bytes

    def with_kv_cache_dtype(self, name: str) -> "ModelSpec":
        """This model with its KV cache in ``name`` (a ``--kv-cache-dtype``; ``auto``: the model's dtype)."""
        return self if name == "auto" else replace(self, kv_dtype_bytes=KV_CACHE_DTYPE_BYTES[name])

    @property
    def layer_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attention = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2  # q, o, k, v
        return attention + 3 * h * self.intermediate_size  # gated MLP

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        return self.num_layers * self.layer_params + embed * (1 if self.tie_word_embeddings else 2)

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def flops_per_token(self) -> float:
        """Matmul FLOPs of one token through every layer (2 per multiply-add)."""
        return 2.0 * self.num_layers * self.layer_params

    @property
    def flops_per_logit_row(self) -> float:
        return 2.0 * self.vocab_size * self.hidden_size

    @property
    def attention_flops_per_pair(self) -> float:
        """FLOPs of one (query, key) pair over all layers and heads: QK^T and PV."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim

    @property
    def kv_bytes_per_token(self) -> float:
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * (self.kv_dtype_bytes or self.dtype_bytes)

    def rank_kv_heads(self, tp: int) -> int:
        """The kv heads one of ``tp`` ranks holds: its share, or one replicated head when there
        are fewer heads than ranks."""
        if tp > self.num_kv_heads:
            if tp % self.num_kv_heads:
                raise ValueError(f"{self.name}: {self.num_kv_heads} kv heads cannot be split or replicated over TP {tp}")
            return 1
        if self.num_kv_heads % tp or self.num_heads % tp or self.intermediate_size % tp:
            raise ValueError(f"{self.name}: TP {tp} does not divide its heads ({self.num_heads} q, "
                             f"{self.num_kv_heads} kv) and MLP ({self.intermediate_size})")
        return self.num_kv_heads // tp

    def rank_kv_bytes_per_token(self, tp: int) -> float:
        return self.kv_bytes_per_token * self.rank_kv_heads(tp) / self.num_kv_heads

    def worker_kv_bytes_per_token(self, tp: int) -> float:
        """What all ``tp`` ranks of a worker hold (and receive) per token: replicated heads count once per rank."""
        return self.rank_kv_bytes_per_token(tp) * tp

    @classmethod
    def from_hf_config(cls, config: dict, name: str) -> "ModelSpec":
        text = config.get("text_config") or config  # multimodal configs nest the decoder
        heads = text["num_attention_heads"]
        return cls(
            name=name, vocab_size=text["vocab_size"], hidden_size=text["hidden_size"],
            intermediate_size=text["intermediate_size"], num_layers=text["num_hidden_layers"],
            num_heads=heads, num_kv_heads=text.get("num_key_value_heads") or heads,
            head_dim=text.get("head_dim") or text["hidden_size"] // heads,
            tie_word_embeddings=bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
            max_model_len=text.get("max_position_embeddings", 8192),
        )


MODELS: dict[str, ModelSpec] = {
    "llama-3-8b": ModelSpec("llama-3-8b", 128256, 4096, 14336, 32, 32, 8, 128, max_model_len=8192),
    "llama-3.1-8b": ModelSpec("llama-3.1-8b", 128256, 4096, 14336, 32, 32, 8, 128, max_model_len=131072),
    "llama-3.1-70b": ModelSpec("llama-3.1-70b", 128256, 8192, 28672, 80, 64, 8, 128, max_model_len=131072),
    "llama-3.2-3b": ModelSpec("llama-3.2-3b", 128256, 3072, 8192, 28, 24, 8, 128, True, 131072),
    "qwen2.5-7b": ModelSpec("qwen2.5-7b", 152064, 3584, 18944, 28, 28, 4, 128, max_model_len=32768),
    "mistral-7b": ModelSpec("mistral-7b", 32768, 4096, 14336, 32, 32, 8, 128, max_model_len=32768),
    "gemma-3-270m": ModelSpec("gemma-3-270m", 262144, 640, 2048, 18, 4, 1, 256, True, 32768),
}


def load_model_spec(model: str) -> ModelSpec:
    """A built-in name, a checkpoint directory, a ``config.json`` file, or ``default``."""
    if model in MODELS:
        return MODELS[model]
    if model == "default":
        from common.engine.loading.checkpoint_path import resolve_checkpoint

        path = Path(resolve_checkpoint(model)) / "config.json"
    else:
        path = Path(model).expanduser()
        if path.is_dir():
            path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"model {model!r}: not a built-in ({', '.join(sorted(MODELS))}) and no config.json "
                         f"at {str(path)!r}")
    try:
        config = json.loads(path.read_text())
        return ModelSpec.from_hf_config(config, path.parent.name)
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"model config {str(path)!r} is not a decoder config this planner understands: "
                         f"{type(exc).__name__}: {exc}") from None


def kv_blocks_per_gpu(gpu: GPUProfile, model: ModelSpec, block_size: int, memory_utilization: float = 0.9,
                      activation_reserve: float = 2 * GB, tp: int = 1) -> int:
    """KV blocks of a worker of ``tp`` GPUs: what fits on each rank next to its share of the
    weights (every rank holds the same block ids), as an engine sized by memory fraction gets."""
    free = gpu.memory_bytes * memory_utilization - model.weight_bytes / tp - activation_reserve
    blocks = int(free // (model.rank_kv_bytes_per_token(tp) * block_size))
    if blocks < 1:
        raise ValueError(f"{model.name} ({model.weight_bytes / GB:.1f} GB of weights) leaves no room for KV "
                         f"on {tp} x {gpu.name} ({gpu.memory_bytes / GB:.0f} GB each): raise the TP size")
    return blocks


def all_reduce_seconds(nbytes: float, tp: int, link: LinkProfile) -> float:
    """A ring all-reduce of ``nbytes`` over ``tp`` ranks on ``link``: 2 (tp - 1) steps, each moving
    1/tp of the data and paying the link's latency."""
    if tp == 1:
        return 0.0
    return 2 * (tp - 1) * (link.latency_s + nbytes / tp / link.bandwidth)
