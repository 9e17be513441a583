"""Tensor parallelism within one worker: each rank of a ``torch.distributed`` group (gloo on CPU,
NCCL on GPU) holds a share of every layer, and the ranks combine their parts where the math needs
the whole.

    part                      rank r holds                           combined by
    attention q heads         heads [r*H/n, (r+1)*H/n)               (local)
    attention k/v heads       kv heads [r*K/n, (r+1)*K/n) if n | K;  (local)
                              else the one kv head its q heads use
                              (replicated: K < n, n % K == 0)
    o_proj, down_proj         the input columns of its heads / MLP   all_reduce (sum) of the output
                              share (row-parallel)
    gate/up_proj              rows [r*I/n, (r+1)*I/n) (column-parallel)
    embedding, LM head        vocabulary rows [r*ceil(V/n), ...)     all_reduce of the lookup; the
                                                                     logits gathered on rank 0 only
    norms, rotary             everything (replicated)

The KV cache of a rank holds its kv heads only.  Rank 0 samples (the only rank with the full
logits) and broadcasts the step's tokens.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from common.engine.model_config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its tensor-parallel group (``size == 1``: no parallelism, no group)."""

    size: int = 1
    rank: int = 0
    group: Any = None  # the model's collectives, on the device's tensors (gloo on CPU, NCCL on GPU)
    # Small host-side messages (the step, sampled tokens, the pool size): gloo even beside NCCL,
    # which takes device tensors only.
    control_group: Any = None

    @classmethod
    def of_process_group(cls, size: int) -> "TensorParallel":
        """This process's rank in the default ``torch.distributed`` group, which must hold ``size`` ranks."""
        if size == 1:
            return cls()
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ValueError(f"tensor_parallel_size {size} needs torch.distributed initialised (one process per rank)")
        if dist.get_world_size() != size:
            raise ValueError(f"tensor_parallel_size {size} but the process group has {dist.get_world_size()} ranks")
        control = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        return cls(size, dist.get_rank(), dist.group.WORLD, control)

    # ---- shares ----------------------------------------------------------------------------

    def split(self, n: int, what: str) -> slice:
        if n % self.size:
            raise ValueError(f"tensor parallelism: {what} ({n}) must divide by the tensor-parallel size {self.size}")
        share = n // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def kv_heads(self, num_heads: int, num_kv_heads: int) -> slice:
        """The kv heads this rank holds: its share when they divide, else (fewer kv heads than
        ranks) the one its q heads attend with, replicated on ``size / num_kv_heads`` ranks."""
        if num_kv_heads >= self.size:
            return self.split(num_kv_heads, "the kv heads")
        if self.size % num_kv_heads:
            raise ValueError(f"tensor parallelism: {num_kv_heads} kv heads cannot be split or replicated over "
                             f"{self.size} ranks (the size must divide by the kv heads, or they by it)")
        head = self.split(num_heads, "the attention heads").start * num_kv_heads // num_heads
        return slice(head, head + 1)

    def kv_head_ranges(self, num_heads: int, num_kv_heads: int) -> list[tuple[int, int]]:
        """The kv heads of every rank of the group, index = rank."""
        ranks = (TensorParallel(self.size, rank).kv_heads(num_heads, num_kv_heads) for rank in range(self.size))
        return [(heads.start, heads.stop) for heads in ranks]

    def vocab(self, vocab_size: int) -> slice:
        """This rank's rows of the embedding and the LM head (the last share may be short)."""
        share = self.vocab_share(vocab_size)
        return slice(min(self.rank * share, vocab_size), min((self.rank + 1) * share, vocab_size))

    def vocab_share(self, vocab_size: int) -> int:
        return -(-vocab_size // self.size)

    def local_config(self, cfg: ModelConfig) -> ModelConfig:
        """``cfg`` with the head and MLP sizes of this rank's share (the vocabulary stays whole)."""
        if self.size == 1:
            return cfg
        heads = self.split(cfg.num_heads, "the attention heads")
        kv = self.kv_heads(cfg.num_heads, cfg.num_kv_heads)
        mlp = self.split(cfg.intermediate_size, "the MLP's intermediate size")
        return dataclasses.replace(cfg, num_heads=heads.stop - heads.start, num_kv_heads=kv.stop - kv.start,
                                   intermediate_size=mlp.stop - mlp.start)

    def shard_state_dict(self, state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
        """This rank's share of a Hugging Face state dict (names unchanged)."""
        if self.size == 1:
            return state
        d = cfg.head_dim
        heads = self.split(cfg.num_heads, "the attention heads")
        kv = self.kv_heads(cfg.num_heads, cfg.num_kv_heads)
        q_rows, kv_rows = slice(heads.start * d, heads.stop * d), slice(kv.start * d, kv.stop * d)
        mlp = self.split(cfg.intermediate_size, "the MLP's intermediate size")
        vocab = self.vocab(cfg.vocab_size)
        out = {}
        for name, t in state.items():
            if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
                t = t[q_rows]
            elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias", "self_attn.v_proj.weight",
                                "self_attn.v_proj.bias")):
                t = t[kv_rows]
            elif name.endswith("self_attn.o_proj.weight"):
                t = t[:, q_rows]
            elif name.endswith(("self_attn.o_proj.bias", "mlp.down_proj.bias")):
                t = t if self.rank == 0 else torch.zeros_like(t)  # added once, after the sum
            elif name.endswith(("mlp.gate_proj.weight", "mlp.up_proj.weight")):
                t = t[mlp]
            elif name.endswith("mlp.down_proj.weight"):
                t = t[:, mlp]
            elif name in ("model.embed_tokens.weight", "lm_head.weight"):
                t = self._vocab_rows(t[vocab], cfg.vocab_size)
            out[name] = t.contiguous()
        return out

    def _vocab_rows(self, rows: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """A vocabulary share padded with zero rows to the common share size."""
        missing = self.vocab_share(vocab_size) - rows.shape[0]
        return rows if missing == 0 else torch.cat([rows, rows.new_zeros(missing, rows.shape[1])])

    # ---- collectives -----------------------------------------------------------------------

    def agree_min(self, value: int) -> int:
        """The smallest ``value`` of all ranks (every rank calls it)."""
        if self.size == 1:
            return value
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of ``x`` over the ranks (in place)."""
        if self.size > 1:
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def embed(self, embedding: torch.nn.Embedding, ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The vocabulary-parallel lookup: each rank its own rows (zeros elsewhere), summed."""
        if self.size == 1:
            return embedding(ids)
        first = self.vocab(vocab_size).start
        local = ids - first
        inside = (local >= 0) & (local < embedding.num_embeddings)
        x = embedding(local.clamp(0, embedding.num_embeddings - 1))
        x = x * inside[:, None].to(x.dtype)
        return self.all_reduce(x)

    def gather_logits(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """The full logits on rank 0 (None on the others) from each rank's vocabulary share."""
        if self.size == 1:
            return local
        import torch.distributed as dist

        parts = [torch.empty_like(local) for _ in range(self.size)] if self.rank == 0 else None
        dist.gather(local.contiguous(), parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1)[:, :vocab_size] if self.rank == 0 else None

    def broadcast_tokens(self, tokens: list[int] | None, count: int) -> list[int]:
        """Rank 0's sampled tokens, on every rank."""
        if self.size == 1:
            return tokens
        import torch.distributed as dist

        t = torch.tensor(tokens, dtype=torch.int64) if self.rank == 0 else torch.empty(count, dtype=torch.int64)
        dist.broadcast(t, src=0, group=self.control_group)
        return t.tolist()
