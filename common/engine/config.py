"""Typed, validated configuration of the engine core.

Every engine setting is declared here once, with its default: the workers' flags
(``worker/config.py``), the local launcher (``make up``), the compose files (which pass an unset
``PDSERVE_*`` variable through empty, so the flag's default applies) and the capacity planner all
read it from here.  The batch limits depend on the device (``SCHEDULING_DEFAULTS``); an
``EngineConfig`` leaves them ``None`` until the engine knows its device (``for_device``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.engine.structured.backend import BACKENDS, DEFAULT_BACKEND
from common.engine.models.quantization_scheme import INT4_GROUP_SIZES, QUANTIZATIONS, Quantization
from common.engine.structured.compiler import DEFAULT_COMPILE_TIMEOUT_S
from common.engine.speculative.speculation import SpeculativeConfig


DTYPES = ("auto", "float32", "float16", "bfloat16")  # the model's (--dtype)
KV_CACHE_DTYPES = (*DTYPES, "fp8")  # the KV cache's (--kv-cache-dtype; auto: the model's; fp8: e4m3, unscaled)


@dataclass(frozen=True)
class SchedulingDefaults:
    """The batch limits of a worker whose flags do not set them."""

    max_num_batched_tokens: int  # tokens computed per step, decodes and prefill chunks together
    max_num_seqs: int  # requests in the running batch


# By device type.  On CPU a step that computes 2048 prompt tokens makes every decode in its batch
# wait for it, so prompts go in smaller chunks; a GPU computes such a step in milliseconds.
SCHEDULING_DEFAULTS: dict[str, SchedulingDefaults] = {
    "cpu": SchedulingDefaults(max_num_batched_tokens=512, max_num_seqs=64),
    "cuda": SchedulingDefaults(max_num_batched_tokens=2048, max_num_seqs=128),
}


def scheduling_defaults(device_type: str) -> SchedulingDefaults:
    """The defaults for ``device_type`` ("cpu", "cuda"; any other accelerator: CUDA's)."""
    return SCHEDULING_DEFAULTS.get(device_type, SCHEDULING_DEFAULTS["cuda"])


def describe_default(field: str) -> str:
    """``field``'s defaults for ``--help``: "512 on CPU, 2048 on CUDA"."""
    return ", ".join(f"{getattr(d, field)} on {device.upper()}" for device, d in SCHEDULING_DEFAULTS.items())


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget scheduling knobs (after vLLM V1 / Sarathi-Serve).  A scheduler built with no
    device in view (the planner's simulator, tests) takes CUDA's batch limits by default."""

    max_num_batched_tokens: int = SCHEDULING_DEFAULTS["cuda"].max_num_batched_tokens
    max_num_seqs: int = SCHEDULING_DEFAULTS["cuda"].max_num_seqs
    max_model_len: int = 4096  # prompt + output tokens of one request
    # Free blocks, as a fraction of the pool, that new prompts may not take: room for running decodes.
    watermark: float = 0.01
    # Decode role: blocks that reservations for incoming remote KV may hold, as a fraction of the
    # pool (one reservation is always allowed, however large), and how long one may wait for its KV.
    remote_kv_budget: float = 0.5
    remote_lease_s: float = 300.0
    # Decode role: how long the oldest refused reservation keeps its claim on the room it needs
    # after its last try (a bit beyond how often a gateway retries a waiting request).
    remote_claim_s: float = 3.0

    def __post_init__(self) -> None:
        _require(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", self.max_num_batched_tokens, ">= 1")
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        _require(self.max_model_len >= 2, "max_model_len", self.max_model_len, ">= 2")
        _require(0.0 <= self.watermark < 1.0, "watermark", self.watermark, "in [0, 1)")
        _require(0.0 < self.remote_kv_budget <= 1.0, "remote_kv_budget", self.remote_kv_budget, "in (0, 1]")
        _require(self.remote_lease_s > 0, "remote_lease_s", self.remote_lease_s, "> 0")
        _require(self.remote_claim_s > 0, "remote_claim_s", self.remote_claim_s, "> 0")


@dataclass(frozen=True)
class EngineConfig:
    """Everything needed to build an ``Engine``.  ``num_blocks`` wins over ``kv_memory_fraction``."""

    model: str  # Hugging Face checkpoint directory, a .gguf file, or "default"
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    # The KV cache's dtype (auto: the model's).  A bfloat16 cache under a float32 model holds twice
    # the tokens and reads half the bytes a decode step; attention still computes in the model's dtype.
    kv_cache_dtype: str = "auto"
    device: str = "auto"  # auto: cuda if available, else cpu
    block_size: int = 16
    num_blocks: int | None = None
    kv_memory_fraction: float = 0.2  # of the memory available at start-up, when num_blocks is None
    max_num_batched_tokens: int | None = None  # None: the device's (SCHEDULING_DEFAULTS)
    max_num_seqs: int | None = None  # None: the device's (SCHEDULING_DEFAULTS)
    max_model_len: int | None = None  # default: the model's own context length
    watermark: float = SchedulerConfig.watermark
    remote_kv_budget: float = SchedulerConfig.remote_kv_budget
    remote_lease_s: float = SchedulerConfig.remote_lease_s
    enable_prefix_caching: bool = True
    attention_backend: str = "auto"  # auto | cpu | torch | flash | triton
    model_id: str | None = None  # name served to clients; default: derived from the checkpoint
    # auto: the checkpoint's weights; dummy: random weights of the checkpoint's shape (config.json
    # alone is enough), for benchmarks of big shapes without a big download (vLLM's --load-format dummy)
    load_format: str = "auto"
    # Decode-only steps replay CUDA graphs captured per batch-size bucket (CUDA with the Triton or
    # flash-attn backend; a no-op elsewhere).
    cuda_graphs: bool = True
    # The decoder layers' work around attention compiled by torch.compile (inductor) for
    # prefill-sized steps, every token bucket at start-up (``common.engine.models.stages``); CPU
    # only (not validated under CUDA graphs yet); eager where compiling fails.
    compile: bool = False
    # Structured output: the grammar backend (llguidance | xgrammar) and how long a grammar may
    # take to compile before its request fails with a 400.
    # Ranks of one model (one process each, torch.distributed initialised by the caller): see
    # common/engine/parallel/tensor_parallel.py.
    tensor_parallel_size: int = 1
    # Weight-only quantization of the projections, the LM head and the embedding
    # (common/engine/models/quantized.py): none | int8 | int4 | fp8; int4's inputs per group.
    quantization: str = Quantization.scheme
    quantization_group_size: int = Quantization.group_size
    structured_output_backend: str = DEFAULT_BACKEND
    grammar_compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S
    # Speculative decoding (common/engine/speculative): the proposer (none | ngram | draft), draft tokens per
    # step, the n-gram sizes and how far back they are looked up, the acceptance below which a
    # request backs off, and the batch size above which nobody speculates (0: none).
    speculative: str = SpeculativeConfig.method
    num_speculative_tokens: int = SpeculativeConfig.num_tokens
    ngram_min: int = SpeculativeConfig.ngram_min
    ngram_max: int = SpeculativeConfig.ngram_max
    ngram_lookup_window: int = SpeculativeConfig.lookup_window
    speculative_min_accepted: float = SpeculativeConfig.min_accepted
    speculative_disable_batch_size: int = SpeculativeConfig.disable_batch_size
    speculative_cost_gate: bool = SpeculativeConfig.cost_gate  # pause where verifying is measured not to pay
    draft_model: str | None = SpeculativeConfig.draft_model  # speculative "draft": its checkpoint
    draft_quantization: str = SpeculativeConfig.draft_quantization  # and how its weights are stored
    draft_vocab_size: int = SpeculativeConfig.draft_vocab_size  # and the common tokens its head scores (0: all)

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, "block_size", self.block_size, ">= 1")
        _require(self.num_blocks is None or self.num_blocks >= 1, "num_blocks", self.num_blocks, ">= 1")
        _require(0.0 < self.kv_memory_fraction <= 1.0, "kv_memory_fraction", self.kv_memory_fraction, "in (0, 1]")
        _require(self.dtype in DTYPES, "dtype", self.dtype, f"one of {', '.join(DTYPES)}")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, "kv_cache_dtype", self.kv_cache_dtype,
                 f"one of {', '.join(KV_CACHE_DTYPES)}")
        _require(self.attention_backend in ("auto", "cpu", "torch", "flash", "triton"), "attention_backend",
                 self.attention_backend, "one of auto, cpu, torch, flash, triton")
        _require(self.load_format in ("auto", "dummy"), "load_format", self.load_format, "one of auto, dummy")
        _require(self.structured_output_backend in BACKENDS, "structured_output_backend",
                 self.structured_output_backend, f"one of {', '.join(BACKENDS)}")
        _require(self.tensor_parallel_size >= 1, "tensor_parallel_size", self.tensor_parallel_size, ">= 1")
        _require(self.quantization in QUANTIZATIONS, "quantization", self.quantization, f"one of {', '.join(QUANTIZATIONS)}")
        _require(self.quantization_group_size in INT4_GROUP_SIZES, "quantization_group_size",
                 self.quantization_group_size, f"one of {INT4_GROUP_SIZES}")
        _require(self.grammar_compile_timeout_s > 0, "grammar_compile_timeout_s", self.grammar_compile_timeout_s, "> 0")
        self.speculation  # validates its knobs
        # The scheduler config validates the remaining knobs (the batch limits as on CUDA, whose default
        # step is the largest: a limit too small for the CPU's is refused once the device is known).
        self._scheduler_config(self.max_model_len or SchedulerConfig.max_model_len, *self._batch_limits("cuda"))

    @property
    def weights(self) -> Quantization:
        """How the model's weights are stored (``quantization`` and its group size)."""
        return Quantization(self.quantization, self.quantization_group_size)

    @property
    def speculation(self) -> SpeculativeConfig:
        """Speculative decoding's settings."""
        return SpeculativeConfig(self.speculative, self.num_speculative_tokens, self.ngram_min, self.ngram_max,
                                 self.ngram_lookup_window, self.speculative_min_accepted,
                                 self.speculative_disable_batch_size, self.speculative_cost_gate,
                                 self.draft_model, self.draft_quantization, self.draft_vocab_size)

    def _batch_limits(self, device_type: str) -> tuple[int, int]:
        return batch_limits(self.max_num_batched_tokens, self.max_num_seqs, scheduling_defaults(device_type),
                            f"the default on {device_type.upper()}")

    def for_device(self, device_type: str) -> "EngineConfig":
        """This config with the batch limits it leaves unset taken from ``device_type``'s defaults."""
        batched, seqs = self._batch_limits(device_type)
        return dataclasses.replace(self, max_num_batched_tokens=batched, max_num_seqs=seqs)

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's config; the batch limits must be set (``for_device``)."""
        if self.max_num_batched_tokens is None or self.max_num_seqs is None:
            raise ValueError("EngineConfig.scheduler_config: resolve the batch limits first (for_device)")
        return self._scheduler_config(max_model_len, self.max_num_batched_tokens, self.max_num_seqs)

    def _scheduler_config(self, max_model_len: int, max_num_batched_tokens: int, max_num_seqs: int) -> SchedulerConfig:
        return SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            watermark=self.watermark,
            remote_kv_budget=self.remote_kv_budget,
            remote_lease_s=self.remote_lease_s,
        )

    def replace(self, **changes) -> "EngineConfig":
        return dataclasses.replace(self, **changes)


def batch_limits(max_num_batched_tokens: int | None, max_num_seqs: int | None, defaults: SchedulingDefaults,
                 defaults_are: str = "the default") -> tuple[int, int]:
    """``(max_num_batched_tokens, max_num_seqs)``, ``defaults`` for those unset (``defaults_are``:
    what they are, for the error).  Every running request decodes in every step only if the step's
    tokens are at least the running requests (else those at the back of the batch, and every prompt
    behind them, wait for the front ones to finish): a set ``max_num_seqs`` above
    ``max_num_batched_tokens`` is refused (as vLLM does), a default one is cut to it.  (The scheduler
    itself takes any pair: its tests drive it with tiny budgets.)"""
    batched = defaults.max_num_batched_tokens if max_num_batched_tokens is None else max_num_batched_tokens
    if max_num_seqs is None:
        return batched, min(defaults.max_num_seqs, batched)
    if max_num_seqs > batched:
        default = "" if max_num_batched_tokens is not None else f", {defaults_are}"
        raise ValueError(f"invalid config: max_num_batched_tokens ({batched}{default}) must be at least "
                         f"max_num_seqs ({max_num_seqs}), or requests in the batch would get no token in a step")
    return batched, max_num_seqs


def _require(ok: bool, field: str, value, expected: str) -> None:
    if not ok:
        raise ValueError(f"invalid config: {field} must be {expected}, got {value!r}")
