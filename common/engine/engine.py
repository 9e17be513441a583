"""The offline engine: ``add_request`` / ``step`` / ``abort``, and ``generate`` on top.

    outputs = scheduler.schedule()          # who computes how many tokens this step
    sampled = runner.execute(outputs)       # one packed forward + sampling
    changed = scheduler.update(outputs, …)  # advance requests, finish, free blocks
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from common.engine.attention.selection import make_attention
from common.engine import cpu_features, cuda_graphs
from common.engine.kv.block_pool import BlockPool
from common.engine.config import EngineConfig
from common.engine.kv.kv_cache import KVCache, KVLayout, dtype_from_name, dtype_name, num_blocks_for_memory
from common.engine.kv.kv_cache_manager import KVCacheManager
from common.engine.loading.checkpoint_path import resolve_checkpoint
from common.engine.loading.model_loader import load_model
from common.engine.loading.tokenizer import load_tokenizer
from common.engine.kv.prefix_hash import MAX_CACHE_SALT_LEN, block_extra_keys
from common.engine.model_runner import ModelRunner
from common.engine.models.quantization_scheme import Quantization
from common.engine.models.stages import compile_stages
from common.engine.request import Request, RequestStatus, resume_request
from common.engine.sampler import TokenLogprobs
from common.engine.sampling_params import SamplingParams, check_prompt_logprobs
from common.engine.scheduler import Scheduler
from common.engine.scheduler_output import SchedulerOutput
from common.engine.parallel.shared_kv import share_caches, shared_host_zeros
from common.engine.parallel.tensor_parallel import TensorParallel
from common.engine.speculative.speculation import Speculation
from common.engine.step_log import StepLog, step_shape
from common.engine.structured.backend import CompiledGrammar, GrammarBackend
from common.engine.structured.compiler import GrammarCompiler, make_backend

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """What one step produced for one request (only the new tokens)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_cached_tokens: int
    num_output_tokens: int
    new_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    num_preemptions: int = 0
    # With the first token of a request that scores its prompt: entry i scores prompt token i + 1.
    prompt_logprobs: list[TokenLogprobs] | None = None
    error: str | None = None  # why it ended with an error (finish_reason "error": its grammar failed)


class StepFailed(Exception):
    """A step raised: the requests it had scheduled (``request_ids``) are finished with an error
    and their blocks freed; the engine itself can go on."""

    def __init__(self, error: BaseException, request_ids: list[str]):
        super().__init__(f"engine step failed: {type(error).__name__}: {error}")
        self.error = error
        self.request_ids = request_ids


class RanksOutOfStep(Exception):
    """A step failed on rank 0 of a tensor-parallel group after it had sent the step to the other
    ranks: they wait in collectives it will not join, or would take its next broadcast for this
    step's -- the engine cannot go on (``StepFailed`` is only for a failure that leaves it sound)."""


@dataclass
class CompletionResult:
    """A finished request from ``Engine.generate``."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[TokenLogprobs | None]
    prompt_logprobs: list[TokenLogprobs] | None = None


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _pick_dtype(name: str, device: torch.device, quantization: str = "none") -> torch.dtype:
    """auto: bf16 on CUDA; fp32 on CPU (the parity reference; bf16 on request, with ``--dtype``)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    dtype = getattr(torch, name)
    if dtype == torch.bfloat16 and device.type == "cpu" and not cpu_features.has_native_bf16():
        log.warning("dtype bfloat16 on a CPU without AVX512-BF16 or AMX: matmuls are emulated and slower "
                    "than float32 here")
    if dtype == torch.bfloat16 and device.type == "cpu" and quantization in ("int8", "int4"):
        # benchmarks/quantized.py, decode-bound: int8_bf16 against int8_kv_bf16, 0.52-0.67x on the CPUs measured
        log.warning("dtype bfloat16 with %s weights on CPU: bf16 rows leave the layers' fused fp32 path and "
                    "are converted at every product (about half the speed); --dtype float32 "
                    "--kv-cache-dtype bfloat16 keeps the KV cache as small and runs faster", quantization)
    return dtype


class Engine:
    """One model, one paged KV cache, one scheduler.  Not thread-safe: one thread drives it."""

    def __init__(self, config: EngineConfig, load_tokenizer: bool = True):
        self.device = _pick_device(config.device)
        self.config = config = config.for_device(self.device.type)  # the batch limits it left to the device
        self.dtype = _pick_dtype(config.dtype, self.device, config.quantization)
        self.kv_dtype = self.dtype if config.kv_cache_dtype == "auto" else dtype_from_name(config.kv_cache_dtype)
        self.checkpoint = resolve_checkpoint(config.model)
        self.tp = TensorParallel.of_process_group(config.tensor_parallel_size)
        self.model, self.model_config = load_model(self.checkpoint, self.dtype, self.device,
                                                   random_weights=config.load_format == "dummy", tp=self.tp,
                                                   quantization=config.weights)
        mc = self.model_config
        if config.compile and self.device.type == "cpu":
            self.model.stages = compile_stages(self.model)
        elif config.compile:
            log.info("compile: not applied on %s (CPU only for now); running eagerly", self.device)
        self.model_id = config.model_id or self.checkpoint.name
        self.layout = KVLayout(
            model_id=self.model_id,
            dtype=dtype_name(self.kv_dtype),
            block_size=config.block_size,
            num_layers=mc.num_layers,
            num_kv_heads=self.tp.local_config(mc).num_kv_heads,  # this rank's share
            head_dim=mc.head_dim,
        )
        num_blocks = config.num_blocks or num_blocks_for_memory(self.layout, config.kv_memory_fraction, self.device)
        # Every rank of a tensor-parallel group holds the same block ids: the pool is the smallest any
        # rank's memory allows (rank 0 allocates ids the others write to).
        num_blocks = self.tp.agree_min(num_blocks)
        windows = {mc.window(layer) for layer in range(mc.num_layers)}
        self.attention = make_attention(config.attention_backend, self.device, windows, config.block_size, self.dtype,
                                        self.kv_dtype)
        use_graphs = config.cuda_graphs and self.tp.size == 1 and cuda_graphs.supported(self.device, self.attention)
        # A follower's cache on CPU lives in shared memory: rank 0 maps it to move its heads between workers.
        buffer, host_fd = None, None
        if self.tp.rank > 0 and self.device.type == "cpu":
            buffer, host_fd = shared_host_zeros(KVCache.buffer_shape(self.layout, num_blocks, use_graphs),
                                                dtype_from_name(self.layout.dtype), f"pdserve-kv-rank{self.tp.rank}")
        self.kv_cache = KVCache(self.layout, num_blocks, self.device, scratch_block=use_graphs, buffer=buffer)
        # Every rank's cache (rank 0; None on the others), as the KV transfer sees them.
        self.kv_shards = share_caches(self.tp, self.kv_cache, self.tp.kv_head_ranges(mc.num_heads, mc.num_kv_heads),
                                      mc.num_kv_heads, host_fd)
        self.max_model_len = min(config.max_model_len or mc.max_model_len, mc.max_model_len)
        self.block_pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        kv_manager = KVCacheManager(self.block_pool, config.block_size)
        self.scheduler = Scheduler(config.scheduler_config(self.max_model_len), kv_manager,
                                   Speculation(config.speculation, self.max_model_len,
                                               self._draft_proposer(num_blocks, kv_manager)))
        if hasattr(self.attention, "block_table"):  # backends that read the persistent table
            self.attention.block_table = self.scheduler.kv_manager.table
        graphs = None
        if use_graphs:
            max_blocks_per_request = -(-self.max_model_len // config.block_size)
            graphs = cuda_graphs.CudaGraphs(self.model, self.kv_cache, self.attention, config.max_num_seqs,
                                            max_blocks_per_request, self.device).capture_all()
        self.runner = ModelRunner(self.model, self.kv_cache, self.attention, self.device, graphs, self.tp)
        self.tokenizer = self._load_tokenizer() if load_tokenizer else None
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._ids = itertools.count()
        self.num_prompt_tokens_total = 0
        self.num_cached_tokens_total = 0
        self.num_steps = 0  # steps that computed something
        self.step_log = StepLog()  # each successful step's end, duration and shape
        # True after a step that could schedule nothing (and preempted nothing): stepping again
        # is of no use until something changes (a request arrives, ends, lands; blocks are freed).
        self.stalled = False
        # Called with a step's schedule before its forward (the engine thread's watchdog reads
        # what kind of step it is).
        self.on_scheduled: Callable[[SchedulerOutput], None] | None = None
        # Tests only: called with the step number before each forward (raise to inject a fault).
        self.fault_injector: Callable[[int], None] | None = None
        log.info(
            "engine ready: model=%s (%s) dtype=%s kv_cache_dtype=%s device=%s attention=%s cuda_graphs=%s "
            "compiled=%s kv_blocks=%d x %d tokens speculative=%s", self.model_id, mc.model_type, dtype_name(self.dtype),
            self.layout.dtype, self.device, self.attention.name, use_graphs, self.model.stages.compiled, num_blocks,
            config.block_size, config.speculative,
        )

    def _draft_proposer(self, num_blocks: int, kv_manager: KVCacheManager):
        """Speculative "draft": the draft model, on this device, at the pool's block ids (rank 0's:
        the other ranks of a tensor-parallel group never propose)."""
        if self.config.speculative != "draft" or self.tp.rank > 0:
            return None
        from common.engine.speculative.draft_model import DraftModelProposer

        draft_weights = Quantization(self.config.draft_quantization, self.config.quantization_group_size)
        return DraftModelProposer(self.config.draft_model, draft_weights,
                                  vocab_size=self.model_config.vocab_size,
                                  num_blocks=num_blocks, block_size=self.config.block_size, dtype=self.dtype,
                                  device=self.device, attention_backend=self.config.attention_backend,
                                  block_table=kv_manager.table, draft_vocab_size=self.config.draft_vocab_size)

    def _load_tokenizer(self):
        try:
            return load_tokenizer(self.checkpoint)
        except (OSError, ValueError) as exc:
            log.warning("no tokenizer in %s (%s); prompts must be token ids", self.checkpoint, exc)
            return None

    @property
    def grammars(self) -> GrammarCompiler:
        """The grammar compiler (built on first use, from any thread).  Its backend is built in a
        compile thread, with the tokenizer (loaded then if the engine was built without one)."""
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self._grammar_backend, timeout_s=self.config.grammar_compile_timeout_s)
            return self._grammars

    def _grammar_backend(self) -> GrammarBackend:
        tokenizer = self.tokenizer if self.tokenizer is not None else self._load_tokenizer()
        if tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer, and this checkpoint has none")
        return make_backend(self.config.structured_output_backend, tokenizer, self.model_config.vocab_size)

    # ---- requests --------------------------------------------------------------------------

    def make_request(
        self, prompt: str | Sequence[int], params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None, cache_salt: str | None = None, grammar: CompiledGrammar | None = None,
        resume_token_ids: Sequence[int] = (),
    ) -> Request:
        """Validate input and build a ``Request``; raises ``ValueError`` naming the problem.

        ``cache_salt``: requests share prefix-cache blocks only with requests of the same salt.
        ``grammar``: ``params.structured`` compiled already (a worker compiles it off the engine
        thread, ``GrammarCompiler.compile_async``); else it is compiled here.
        ``resume_token_ids``: output tokens another worker already produced for this request (a
        stream that moved, ``resume_request``); the request continues after them."""
        if isinstance(params, dict):
            params = SamplingParams.from_dict(params)
        params = params or SamplingParams()
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model has no tokenizer: pass the prompt as token ids")
            prompt_ids = self.tokenizer(prompt).input_ids
        else:
            prompt_ids = list(prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty: at least one token is required")
        vocab = self.model_config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if any(t >= vocab for t, _ in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        check_prompt_logprobs(len(prompt_ids), params.prompt_logprobs)
        matcher = None
        if params.structured is not None:
            matcher = (grammar or self.grammars.compile(params.structured)).matcher()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if cache_salt is not None and not 1 <= len(cache_salt) <= MAX_CACHE_SALT_LEN:
            raise ValueError(f"cache_salt must be 1-{MAX_CACHE_SALT_LEN} characters, got {len(cache_salt)}")
        request = Request(request_id, prompt_ids, params, eos_token_ids=self.model_config.eos_token_ids,
                          extra_keys=block_extra_keys(self.model_id, cache_salt), grammar=matcher)
        if resume_token_ids:
            resume_request(request, resume_token_ids, vocab, self.max_model_len)
            request.prompt_scored_elsewhere()  # the client had the scores with the stream's first tokens
        return request

    def add_request(
        self, prompt: str | Sequence[int], params: SamplingParams | dict[str, Any] | None = None,
        request_id: str | None = None, cache_salt: str | None = None, grammar: CompiledGrammar | None = None,
        resume_token_ids: Sequence[int] = (),
    ) -> str:
        request = self.make_request(prompt, params, request_id, cache_salt, grammar, resume_token_ids)
        self.scheduler.add_request(request)
        return request.request_id

    def abort(self, request_id: str) -> bool:
        """Stop a request now and free its blocks; ``False`` if it was not running here."""
        return self.scheduler.abort(request_id) is not None

    # ---- stepping --------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, compute and advance one step.  Raises ``StepFailed`` if the forward or the
        update failed (the step's requests are then finished with an error), ``RanksOutOfStep``
        instead with tensor parallelism."""
        began = time.perf_counter()
        out = self.scheduler.schedule()
        self.stalled = out.is_empty and not out.preempted_request_ids
        if out.is_empty:
            return []
        self.num_steps += 1
        if self.on_scheduled is not None:
            self.on_scheduled(out)
        try:
            if self.fault_injector is not None:
                self.fault_injector(self.num_steps)
            sampled = self.runner.execute(out)
            for request_id, entries in self.runner.prompt_logprobs.items():
                scored = self.scheduler.requests[request_id]
                scored.prompt_logprobs.extend(entries)
                scored.num_scored_tokens += len(entries)
            changed = self.scheduler.update(out, {rid: tokens for rid, (tokens, _lp) in sampled.items()})
        except Exception as exc:
            failed = [item.request_id for item in out.scheduled]
            for request_id in failed:
                self.scheduler.abort(request_id, RequestStatus.FINISHED_ERROR)
            log.error("step %d failed (%s: %s); its %d requests end with an error",
                      self.num_steps, type(exc).__name__, exc, len(failed))
            if self.runner.followers_out_of_step:
                raise RanksOutOfStep(f"step {self.num_steps} failed on rank 0 of {self.tp.size}: "
                                     f"{type(exc).__name__}: {exc}") from exc
            raise StepFailed(exc, failed) from exc
        outputs = []
        for request in changed:
            token_ids, logprobs = sampled[request.request_id]  # cut by ``update`` to the tokens taken
            if request.num_output_tokens == 1:
                self._count_prefix_hit(request)
            outputs.append(self._output(request, token_ids, logprobs[: len(token_ids)]))
            if outputs[-1].prompt_logprobs is not None:
                request.prompt_logprobs = []  # handed out: not kept while the request decodes
        seconds = time.perf_counter() - began
        self.step_log.record(time.time(), seconds, step_shape(out.scheduled))
        self.scheduler.speculation.observe_step(out.scheduled, seconds, sum(len(o.new_token_ids) for o in outputs))
        return outputs

    def _count_prefix_hit(self, request: Request) -> None:
        self.num_prompt_tokens_total += request.num_prompt_tokens
        self.num_cached_tokens_total += request.num_cached_tokens or 0

    @staticmethod
    def _output(request: Request, token_ids: list[int], logprobs: list) -> RequestOutput:
        first = request.num_output_tokens == len(token_ids)  # the request's first output
        return RequestOutput(
            request_id=request.request_id,
            new_token_ids=token_ids,
            finished=request.is_finished,
            finish_reason=request.status.finish_reason,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens or 0,
            num_output_tokens=request.num_output_tokens,
            new_logprobs=logprobs,
            num_preemptions=request.num_preemptions,
            prompt_logprobs=request.prompt_logprobs if first and request.sampling_params.prompt_logprobs is not None
            else None,
            error=request.error,
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def has_work(self) -> bool:
        """Whether a step could do anything now (``Scheduler.has_work``: requests waiting for remote
        KV, or for blocks only reservations, landed requests or pins can free, do not count)."""
        return self.scheduler.has_work()

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | dict | None = None
    ) -> list[CompletionResult]:
        """Run ``prompts`` to completion with continuous batching; results in prompt order."""
        requests = [self.make_request(p, params) for p in prompts]
        results: dict[str, CompletionResult] = {}
        added: list[str] = []
        try:
            for request in requests:
                self.scheduler.add_request(request)
                added.append(request.request_id)
                results[request.request_id] = CompletionResult(
                    request.request_id, request.prompt_token_ids, [], None, None, 0, []
                )
            while any(results[request_id].finish_reason is None for request_id in added):
                for output in self.step():
                    result = results.get(output.request_id)
                    if result is None:
                        continue
                    result.token_ids.extend(output.new_token_ids)
                    result.logprobs.extend(output.new_logprobs)
                    if output.prompt_logprobs is not None:
                        result.prompt_logprobs = output.prompt_logprobs
                    result.num_cached_tokens = output.num_cached_tokens
                    if output.finished:
                        result.finish_reason = output.finish_reason
        finally:
            for request_id in added:
                if results[request_id].finish_reason is None:
                    self.abort(request_id)
        ordered = [results[r.request_id] for r in requests]
        if self.tokenizer is not None:
            for result in ordered:
                result.text = self.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        return ordered

    # ---- tensor parallelism ----------------------------------------------------------------

    def follow(self) -> int:
        """Ranks other than 0 of a tensor-parallel group: run rank 0's steps (their shares of every
        layer) until it says stop; returns the steps run."""
        if self.tp.rank == 0:
            raise RuntimeError("rank 0 schedules; only the other ranks follow")
        steps = 0
        while (out := self.runner.steps.receive()) is not None:
            self.runner.execute(out)
            steps += 1
        return steps

    def stop_followers(self) -> None:
        """Rank 0: tell the other ranks of the group that no step follows."""
        if self.runner.steps is not None and self.tp.rank == 0:
            self.runner.steps.send_stop()

    # ---- introspection ---------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
        s = self.scheduler
        # Prompt tokens still to compute: waiting requests and running ones mid-prefill (chunked).
        waiting_tokens = sum(r.num_tokens - r.num_computed_tokens for r in s.waiting) + sum(
            r.num_prompt_tokens - r.num_computed_tokens for r in s.running
            if r.num_computed_tokens < r.num_prompt_tokens)
        return {
            "num_running": len(s.running),
            "num_waiting": s.num_waiting,
            "num_waiting_for_remote_kv": s.num_waiting_for_remote,
            "num_reserved_blocks": s.num_reserved_blocks,
            "num_waiting_prefill_tokens": waiting_tokens,
            "kv_usage": self.block_pool.usage,
            "num_free_blocks": self.block_pool.num_free_blocks,
            "num_blocks": self.block_pool.num_blocks,
            "num_preemptions": s.num_preemptions,
            "prompt_tokens_total": self.num_prompt_tokens_total,
            "prefix_cache_hit_tokens_total": self.num_cached_tokens_total,
            **self.scheduler.speculation.stats.as_dict(),
        }
