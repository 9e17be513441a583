"""One decoder for the Llama family (Llama 2/3, Mistral, Qwen 2/2.5/3) and Gemma 3.

Parameter names follow the Hugging Face checkpoints, so a safetensors state dict loads as is;
q/k/v and gate/up are fused after loading (one matmul each instead of three and two).
The forward runs over a packed batch of tokens from many requests (see ``common.engine.attention.interface``).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from common.engine.attention.interface import AttentionMetadata, OutputRows
from common.engine.kv.kv_cache import KVCache
from common.engine.model_config import ModelConfig
from common.engine.models.quantization_scheme import NO_QUANTIZATION, Quantization
from common.engine.models.quantized import (Int4Weight, QuantizedEmbedding, QuantizedWeight, quantize_weight,
                                            quantized_linear)
from common.engine.models.activations import ACTIVATIONS, gated
from common.engine.models.linear import Linear, linear, pack_weight, packed_linear, tune_row_padding
from common.engine.models.fused_layers import FusedLayers
from common.engine.models.greedy_head import GreedyHead, uniforms_per_row
from common.engine.models.panels import PanelWeight, max_rows, pack_panels
from common.engine.models.stages import EAGER, LayerStages
from common.engine.models import norm_rope
from common.engine.models.rotary import RotaryEmbedding, apply_rotary, rotate
from common.engine.parallel.tensor_parallel import TensorParallel

if TYPE_CHECKING:
    from common.engine.loading.gguf_blocks import SourceWeights

SINGLE = TensorParallel()  # one rank: no collectives

log = logging.getLogger(__name__)
# Below this many bytes of packed weights a model's products are too quick for their row count to
# matter (and too quick to time apart): no row padding is tuned.
ROW_PADDING_MIN_BYTES = 32 << 20
# The checkpoint's projections each fused product is made of (``Attention.fuse``, ``MLP.fuse``).
FUSED_FROM = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
EMBEDDING = "model.embed_tokens"  # the embedding module's name (its weight: the checkpoint's ``<EMBEDDING>.weight``)

class RMSNorm(nn.Module):
    """RMSNorm computed in fp32; Gemma's ``(1 + w)`` is folded into the weight after loading."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if norm_rope.applies(x, self.weight):
            return norm_rope.norm_rope(x, self.weight, self.eps)
        if norm_rope.widened_applies(x, self.weight):
            return norm_rope.norm_widened(x, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x).to(dtype)

    def added_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)`` (one kernel call where ``norm_rope`` applies)."""
        if norm_rope.applies(x, self.weight, residual):
            return norm_rope.norm_rope(x, self.weight, self.eps, residual=residual)
        return residual + self(x)

    def rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``apply_rotary(self(x), cos, sin)`` for ``x`` [tokens, heads, head_dim] (one kernel call
        where ``norm_rope`` applies)."""
        if norm_rope.applies(x, self.weight, cos):
            return norm_rope.norm_rope(x, self.weight, self.eps, cos=cos, sin=sin)
        return apply_rotary(self(x), cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.window = cfg.window(layer)
        self.layer_type = cfg.layer_types[layer]
        self.scale = cfg.attn_scale
        q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, q_size, bias=cfg.qkv_bias)
        self.k_proj = Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.v_proj = Linear(cfg.hidden_size, kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(q_size, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.qkv_proj: Linear | None = None
        self.split = (q_size, kv_size, kv_size)

    def fuse(self) -> None:
        qkv = Linear(self.q_proj.in_features, sum(self.split), bias=self.q_proj.bias is not None)
        qkv = qkv.to(self.q_proj.weight.device, self.q_proj.weight.dtype)
        with torch.no_grad():
            qkv.weight.copy_(torch.cat([self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]))
            if qkv.bias is not None:
                qkv.bias.copy_(torch.cat([self.q_proj.bias, self.k_proj.bias, self.v_proj.bias]))
        self.qkv_proj = qkv
        del self.q_proj, self.k_proj, self.v_proj

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """The queries, keys and values of ``x`` (normed, rotated), each ``[tokens, heads, head_dim]``."""
        tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.split, dim=-1)
        q = q.view(tokens, self.num_heads, self.head_dim)
        k = k.view(tokens, self.num_kv_heads, self.head_dim)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            return self.q_norm.rotated(q, cos, sin), self.k_norm.rotated(k, cos, sin), v
        return rotate(q, cos, sin), rotate(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_name = cfg.hidden_act
        if cfg.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {cfg.hidden_act!r}")
        self.gate_up_proj: Linear | None = None

    def fuse(self) -> None:
        fused = Linear(self.gate_proj.in_features, 2 * self.gate_proj.out_features, bias=False)
        fused = fused.to(self.gate_proj.weight.device, self.gate_proj.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([self.gate_proj.weight, self.up_proj.weight]))
        self.gate_up_proj = fused
        del self.gate_proj, self.up_proj

    def forward(self, x):
        return self.tp.all_reduce(self.down_proj(gated(self.gate_up_proj(x), self.act_name)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.tp = tp
        self.sandwich = cfg.sandwich_norms
        self.self_attn = Attention(cfg, layer)
        self.mlp = MLP(cfg, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # Llama: the norm before the MLP.  Gemma: the norm after attention (sandwich).
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Everything before attention: the input norm and the attention's q, k, v."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def after_attention(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Everything after attention: output projection, norms, residuals and the MLP."""
        h = self.tp.all_reduce(self.self_attn.o_proj(attended.reshape(x.shape[0], -1)))
        if self.sandwich:
            x = self.post_attention_layernorm.added_to(x, h)
            return self.post_feedforward_layernorm.added_to(x, self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, rope, cache, meta, backend, stages: LayerStages = EAGER):
        attn = self.self_attn
        cos, sin = rope[attn.layer_type]
        q, k, v = stages.attention_inputs(self, x, cos, sin)
        attended = backend.forward(q, k, v, cache, attn.layer, meta, attn.window, attn.scale)
        return stages.after_attention(self, x, attended)

    def forward_rows(self, x, rope, cache, meta, backend, output: OutputRows, stages: LayerStages = EAGER):
        """``forward`` for ``output.rows`` of ``x`` alone: every token's K/V goes to the cache, but
        attention and everything after it run for those rows (none where ``output.meta`` is None)."""
        attn = self.self_attn
        cos, sin = rope[attn.layer_type]
        q, k, v = stages.attention_inputs(self, x, cos, sin)
        if output.meta is None:
            backend.write_kv(k, v, cache, attn.layer, meta)
            return x[:0]
        rows = output.rows
        if rows.numel() < x.shape[0]:  # the rows' own K/V are written by the forward below
            backend.write_kv(k, v, cache, attn.layer, meta)
        attended = backend.forward(q[rows], k[rows], v[rows], cache, attn.layer, output.meta, attn.window, attn.scale)
        return stages.after_attention(self, x[rows], attended)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        # Given its weight, Embedding skips its random init: on the meta device that init imports
        # torch._dynamo (~1.7 s of a worker's start), and the loader overwrites the weight anyway.
        rows = tp.vocab_share(cfg.vocab_size)
        self.embed_tokens = nn.Embedding(rows, cfg.hidden_size, _weight=torch.empty(rows, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderModel(nn.Module):
    """A causal LM over paged KV: ``forward`` returns the final hidden states of all tokens, or of
    those an ``OutputRows`` names; ``logits`` projects only the rows that sample.  With tensor
    parallelism (``tp``), ``cfg`` is this rank's share (``TensorParallel.local_config``) and
    ``logits`` are whole on rank 0 only."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.model = Backbone(cfg, tp)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, tp.vocab_share(cfg.vocab_size), bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.stages: LayerStages = EAGER  # ``compile_stages`` swaps in compiled ones
        self.packed_lm_head: torch.Tensor | None = None  # a tied LM head's packed copy
        self.lm_head_panels: PanelWeight | None = None  # and its copy for few rows
        self.quantized_lm_head: QuantizedWeight | None = None  # a tied LM head's quantized rows
        self.greedy_head: GreedyHead | None = None  # see screened_tokens
        self.row_padding: tuple[int, ...] = ()  # see _tune_row_padding
        self.used_prepacked = False  # see finish_loading
        self.fuse_layers = True  # small eager fp32 steps through ``FusedLayers`` where it applies
        self._fused_layers: tuple | None = None  # (cache, backend, FusedLayers or None)

    def finish_loading(self, device: torch.device, quantization: Quantization = NO_QUANTIZATION,
                       source: SourceWeights | None = None,
                       prepacked: dict[str, QuantizedWeight] | None = None) -> None:
        """After the state dict is in: fold Gemma's norm offset, fuse projections, pack the CPU
        products' weights (``common.engine.models.linear``) or quantize them, the LM head and
        the embedding (``common.engine.models.quantized``; ``source``: how a GGUF stored them,
        see ``common.engine.loading.gguf_blocks``), build RoPE.  ``prepacked``: the quantized
        weights of an earlier load (``quantized_weights()``), used instead of quantizing where
        they are exactly the weights this model quantizes (``used_prepacked`` says whether)."""
        offset = self.cfg.norm_weight_offset
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, RMSNorm) and offset:
                    module.weight.add_(offset)
        for layer in self.model.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        if quantization.enabled:
            self._quantize(quantization, source, prepacked)
        else:
            for module in self.modules():
                if isinstance(module, Linear):
                    module.pack()
            if self.cfg.tie_word_embeddings:  # the embedding keeps its plain rows for the lookup
                self.packed_lm_head = pack_weight(self.model.embed_tokens.weight)
                if self.packed_lm_head is not None:
                    self.lm_head_panels = pack_panels(self.model.embed_tokens.weight)
            self._build_greedy_head()
            self._log_panels()
        self._tune_row_padding()
        self.rotary = RotaryEmbedding(self.cfg.rope, device)

    def _quantize(self, quantization: Quantization, source: SourceWeights | None,
                  prepacked: dict[str, QuantizedWeight] | None) -> None:
        head = getattr(self, "lm_head", None)
        targets = {name: module for name, module in self.named_modules() if isinstance(module, Linear)}
        shapes = {name: tuple(module.weight.shape) for name, module in targets.items()}
        shapes[EMBEDDING] = tuple(self.model.embed_tokens.weight.shape)
        self.used_prepacked = prepacked is not None and _prepacked_fits(prepacked, shapes, quantization)
        if prepacked is not None and not self.used_prepacked:
            log.warning("the prepacked weights do not match this model's (%d weights, %s): quantizing again",
                        len(shapes), quantization.scheme)
        for name, module in targets.items():
            if self.used_prepacked:
                module.use_quantized(prepacked[name])
                continue
            parent, _, leaf = name.rpartition(".")
            weights = [".".join(filter(None, (parent, part, "weight"))) for part in FUSED_FROM.get(leaf, (leaf,))]
            module.use_quantized(_quantized(module.weight, weights, quantization, source, head=module is head))
        embedding = self.model.embed_tokens.weight
        # a head's rows: int8 under int4
        rows = (prepacked[EMBEDDING] if self.used_prepacked
                else _quantized(embedding, [f"{EMBEDDING}.weight"], quantization, source, head=True))
        self.model.embed_tokens = QuantizedEmbedding(rows)
        if self.cfg.tie_word_embeddings:
            self.quantized_lm_head = rows  # one quantized copy for the lookup and the head

    def quantized_weights(self) -> dict[str, QuantizedWeight]:
        """Every quantized weight by the name of the module computing with it (the embedding's rows
        under ``model.embed_tokens``, which a tied head shares): ``finish_loading``'s ``prepacked``."""
        weights = {name: module.quantized for name, module in self.named_modules()
                   if isinstance(module, Linear) and module.quantized is not None}
        if isinstance(self.model.embed_tokens, QuantizedEmbedding):
            weights[EMBEDDING] = self.model.embed_tokens.quantized
        return weights

    def weight_bytes(self) -> int:
        """Bytes the weights occupy as stored (packed, quantized: each copy once)."""
        tensors = [*self.parameters(), *self.buffers()]
        if self.packed_lm_head is not None:
            tensors.append(self.packed_lm_head)
        total = sum(t.numel() * t.element_size() for t in tensors) + sum(p.nbytes for p in self._panel_weights())
        total += self.greedy_head.nbytes if self.greedy_head is not None else 0
        quantized = {id(q): q for module in self.modules()
                     for q in (getattr(module, "quantized", None), getattr(module, "quantized_lm_head", None))
                     if q is not None}
        return total + sum(q.nbytes for q in quantized.values())

    def _panel_weights(self) -> list[PanelWeight]:
        panels = [m.panels for m in self.modules() if isinstance(m, Linear) and m.panels is not None]
        return panels + ([self.lm_head_panels] if self.lm_head_panels is not None else [])

    def _log_panels(self) -> None:
        panels = self._panel_weights()
        if panels:
            log.info("%d weights also packed in panels for products of up to %d rows (+%.0f MB)",
                     len(panels), max_rows(panels[0].dtype), sum(p.nbytes for p in panels) / 1e6)
        if self.greedy_head is not None:
            log.info("greedy steps screen the LM head in bf16 (+%.0f MB)", self.greedy_head.nbytes / 1e6)

    def _build_greedy_head(self) -> None:
        """The screened head for greedy steps (``common.engine.models.greedy_head``): an fp32 head
        with panels, whole on this rank, whose logits are the product itself (no soft-capping,
        which could tie rows the product keeps apart)."""
        if self.tp.size != 1 or self.cfg.final_logit_softcapping:
            return
        head = self.lm_head_panels if self.cfg.tie_word_embeddings else self.lm_head.panels
        self.greedy_head = GreedyHead.build(head)

    def _tune_row_padding(self) -> None:
        """Time this model's packed products for few rows and pad where more rows run faster
        (``common.engine.models.linear.tune_row_padding``); a model too small for a product's
        time to matter (the tests' tiny ones) is left alone, and so is one whose products of
        few rows all run on panels (``common.engine.models.panels``)."""
        packed = [m.packed_weight for m in self.modules() if isinstance(m, Linear) and m.packed_weight is not None]
        if self.packed_lm_head is not None:
            packed.append(self.packed_lm_head)
        if not packed or sum(w.numel() * w.element_size() for w in packed) < ROW_PADDING_MIN_BYTES:
            return
        if len(self._panel_weights()) == len(packed):
            return
        self.set_row_padding(tune_row_padding(packed))
        if self.row_padding != tuple(range(len(self.row_padding))):
            log.info("products of few rows computed with more (rows -> rows computed): %s",
                     {rows: to for rows, to in enumerate(self.row_padding) if to != rows})

    def set_row_padding(self, table: tuple[int, ...]) -> None:
        """Compute every packed product with ``table`` (``tune_row_padding``'s; ``()``: none)."""
        self.row_padding = table
        for module in self.modules():
            if isinstance(module, Linear):
                module.row_padding = table

    @torch.inference_mode()
    def forward(self, input_ids, positions, cache: KVCache, meta: AttentionMetadata, backend,
                output: OutputRows | None = None) -> torch.Tensor:
        """The final hidden states (before the last norm) of every token, or of ``output.rows``
        alone: then the last layer computes attention and what follows for those rows only (on the
        eager or compiled layers; the fused layers compute every row and keep those)."""
        x = self.tp.embed(self.model.embed_tokens, input_ids, self.cfg.vocab_size)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        rope = {t: self.rotary.cos_sin(positions, t, x.dtype) for t in set(self.cfg.layer_types)}
        fused = self._fused_for(cache, backend)
        if fused is not None and fused.applies(x, meta):
            x = fused.run(x, rope, meta)
            return x if output is None else x[output.rows]
        *layers, last = self.model.layers
        for layer in layers:
            x = layer(x, rope, cache, meta, backend, self.stages)
        if output is None:
            return last(x, rope, cache, meta, backend, self.stages)
        return last.forward_rows(x, rope, cache, meta, backend, output, self.stages)

    def _fused_for(self, cache: KVCache, backend) -> FusedLayers | None:
        """The layers set up for ``FusedLayers`` over this cache and backend (built on first use)."""
        if not self.fuse_layers:
            return None
        if self._fused_layers is None or self._fused_layers[0] is not cache or self._fused_layers[1] is not backend:
            self._fused_layers = (cache, backend, FusedLayers.build(self, cache, backend))
        return self._fused_layers[2]

    @torch.inference_mode()
    def screened_tokens(self, hidden: torch.Tensor, inverse_temperatures: list[float]) -> torch.Tensor | None:
        """Each row's token without the logits, where the screened head applies: the first index of
        its largest logit in the head's fp32 panel product (which ``logits`` takes for up to
        ``PANEL_MAX_ROWS`` rows) where ``inverse_temperatures`` says 0, else a sample of
        softmax(logits / T) (``sampler.screen_inverse_temperatures``; the random numbers from torch's
        generator, as the sampler's unseeded rows draw theirs), or -1 for a sampled row the screen
        left undecided (the caller samples that row from its logits).  ``None`` where it does not
        apply (or cannot decide: a value not finite), or where more rows than the head's
        ``max_rows`` would gain nothing: the caller computes the logits.  A quantized head whose
        kernel finds a row's maximum without its logits (int8 on VNNI or AVX2 CPUs) gives greedy steps'
        tokens the same way: the first maximal index of the logits ``logits`` would compute."""
        head = self.greedy_head
        if head is None:
            return self._quantized_greedy_tokens(hidden, inverse_temperatures)
        if hidden.dtype != torch.float32 or hidden.device.type != "cpu":
            return None
        if len(hidden) > head.max_rows:
            return None
        hidden = self.model.norm(hidden)
        if not any(inverse_temperatures):
            return head.argmax(hidden)
        uniforms = torch.rand(len(inverse_temperatures), uniforms_per_row(), dtype=torch.float64)
        return head.sample(hidden, torch.tensor(inverse_temperatures, dtype=torch.float32), uniforms)

    def _quantized_greedy_tokens(self, hidden: torch.Tensor, inverse_temperatures: list[float]) -> torch.Tensor | None:
        head = self.quantized_lm_head if self.cfg.tie_word_embeddings else getattr(self, "lm_head", None)
        head = getattr(head, "quantized", head)  # an untied head's Linear holds its quantized weight
        if (head is None or any(inverse_temperatures) or self.tp.size != 1 or self.cfg.final_logit_softcapping
                or hidden.device.type != "cpu"):
            return None
        return head.greedy_tokens(self.model.norm(hidden))

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """The logits of ``hidden``'s rows (None on tensor-parallel ranks other than 0)."""
        hidden = self.model.norm(hidden)
        if not self.cfg.tie_word_embeddings:
            logits = self.lm_head(hidden).float()
        elif self.quantized_lm_head is not None:
            logits = quantized_linear(hidden, self.quantized_lm_head, None).float()
        elif self.packed_lm_head is not None:
            logits = packed_linear(hidden, self.packed_lm_head, row_padding=self.row_padding,
                                   panels=self.lm_head_panels).float()
        else:
            logits = linear(hidden, self.model.embed_tokens.weight).float()
        logits = self.tp.gather_logits(logits, self.cfg.vocab_size)
        if logits is None:
            return None
        cap = self.cfg.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits


def _prepacked_fits(prepacked: dict[str, QuantizedWeight], shapes: dict[str, tuple[int, ...]],
                    quantization: Quantization) -> bool:
    """Whether ``prepacked`` holds exactly the weights of ``shapes`` (name -> [out, in]) under
    ``quantization``'s scheme (a head and a GGUF's wider blocks are int8 under int4; which group
    size an int4 weight has is the cache key's business: ``common.engine.loading.prepack_cache``)."""
    if set(prepacked) != set(shapes):
        return False
    kinds = {quantization.scheme, "int8"} if quantization.scheme == "int4" else {quantization.scheme}
    return all(w.kind in kinds and (w.out_features, w.in_features) == shapes[name] for name, w in prepacked.items())


def _quantized(weight: torch.Tensor, names: list[str], quantization: Quantization, source: SourceWeights | None,
               head: bool) -> QuantizedWeight:
    """``weight`` (made of checkpoint weights ``names``) under ``quantization``: under int4 a GGUF's
    4-bit blocks as the file has them, and its wider blocks at int8 (``gguf_blocks``)."""
    scheme = quantization.scheme
    if source is not None and scheme == "int4" and not head:
        groups = source.int4_groups(names)
        if groups is not None:
            return Int4Weight.from_groups(*groups, source.group_size, weight.dtype)
        if source.holds_more_than_four_bits(names):
            scheme = "int8"
    return quantize_weight(weight, scheme, quantization.group_size, head)
