"""The token ids of requests with penalties, as tensors kept across steps (``Sampler``'s): a step
converts only the tokens generated since the last one."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch


@dataclass
class TokenHistory:
    """One request's token ids as tensors, kept across steps so a step only converts new tokens."""

    outputs_list: Sequence[int]
    prompt_unique: torch.Tensor
    outputs: torch.Tensor  # capacity >= num_outputs
    num_outputs: int = 0

    def output_ids(self) -> torch.Tensor:
        new = self.outputs_list[self.num_outputs :]
        if new:
            end = self.num_outputs + len(new)
            if end > self.outputs.numel():
                grown = torch.empty(max(2 * end, 64), dtype=torch.int64, device=self.outputs.device)
                grown[: self.num_outputs] = self.outputs[: self.num_outputs]
                self.outputs = grown
            self.outputs[self.num_outputs : end] = torch.tensor(new, dtype=torch.int64)
            self.num_outputs = end
        return self.outputs[: self.num_outputs]


class TokenHistories:
    """Token-id tensors of the requests with penalties, by request id (dropped when a request is
    not sampled in a step: it finished, was aborted or preempted, and is rebuilt if it returns)."""

    def __init__(self) -> None:
        self._by_id: dict[str, TokenHistory] = {}

    def get(self, row: Any, device: torch.device) -> TokenHistory:
        """``row``: a ``common.engine.sampler.SamplingRequest`` (not imported: the sampler imports this)."""
        history = self._by_id.get(row.request_id) if row.request_id else None
        if (history is None or history.outputs_list is not row.output_token_ids
                or len(row.output_token_ids) < history.num_outputs):
            prompt = torch.tensor(list(row.prompt_token_ids), dtype=torch.int64, device=device).unique()
            history = TokenHistory(row.output_token_ids, prompt, torch.empty(0, dtype=torch.int64, device=device))
            if row.request_id:
                self._by_id[row.request_id] = history
        return history

    def keep_only(self, request_ids: set[str]) -> None:
        for request_id in [r for r in self._by_id if r not in request_ids]:
            del self._by_id[request_id]
