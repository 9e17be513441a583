"""Rank 0 of a tensor-parallel group schedules; every step's work goes to the other ranks as one
int64 tensor (no pickle), and they run the same forward on their shares.

    [num_items, then per item: num_tokens, num_computed_tokens, num_blocks, sample, num_drafts,
     prompt logprob rows' start, their end, token ids..., block ids...]

A length of 0 tells the followers to stop.  What a follower needs of a step is what the model
runner reads (tokens, positions, blocks, which rows sample: the last token's and a speculating
request's drafts'; which rows score the prompt: every rank takes part in their projections); the
sampling and the scoring themselves are rank 0's.
"""
from __future__ import annotations

import torch

from common.engine.parallel.tensor_parallel import TensorParallel
from common.engine.sampling_params import SamplingParams
from common.engine.scheduler_output import ScheduledRequest, SchedulerOutput

_FOLLOWER_PARAMS = SamplingParams()  # followers never sample


def encode_step(out: SchedulerOutput) -> torch.Tensor:
    values = [len(out.scheduled)]
    for item in out.scheduled:
        values += [len(item.token_ids), item.num_computed_tokens, len(item.block_ids), int(item.sample),
                   len(item.draft_token_ids), *item.prompt_logprob_rows]
        values += item.token_ids
        values += item.block_ids
    return torch.tensor(values, dtype=torch.int64)


def decode_step(data: torch.Tensor) -> SchedulerOutput:
    values = data.tolist()
    count, pos, scheduled = values[0], 1, []
    for i in range(count):
        num_tokens, computed, num_blocks, sample, num_drafts, scored_begin, scored_end = values[pos:pos + 7]
        pos += 7
        tokens = values[pos:pos + num_tokens]
        pos += num_tokens
        blocks = values[pos:pos + num_blocks]
        pos += num_blocks
        scheduled.append(ScheduledRequest(request_id=f"follower-{i}", token_ids=tokens, num_computed_tokens=computed,
                                          block_ids=blocks, sample=bool(sample), sampling_params=_FOLLOWER_PARAMS,
                                          num_output_tokens=0, draft_token_ids=tokens[num_tokens - num_drafts:]
                                          if num_drafts else [], prompt_logprob_rows=(scored_begin, scored_end)))
    return SchedulerOutput(scheduled=scheduled, num_scheduled_tokens=sum(len(s.token_ids) for s in scheduled))


class StepBroadcast:
    """Sends (rank 0) and receives (the others) the steps of one tensor-parallel group."""

    def __init__(self, tp: TensorParallel):
        self.tp = tp

    def send(self, out: SchedulerOutput) -> None:
        self._send(encode_step(out))

    def send_stop(self) -> None:
        self._send(torch.empty(0, dtype=torch.int64))

    def _send(self, data: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.broadcast(torch.tensor([data.numel()], dtype=torch.int64), src=0, group=self.tp.control_group)
        if data.numel():
            dist.broadcast(data, src=0, group=self.tp.control_group)

    def receive(self) -> SchedulerOutput | None:
        """The next step, or None when rank 0 says stop."""
        import torch.distributed as dist

        length = torch.empty(1, dtype=torch.int64)
        dist.broadcast(length, src=0, group=self.tp.control_group)
        if int(length) == 0:
            return None
        data = torch.empty(int(length), dtype=torch.int64)
        dist.broadcast(data, src=0, group=self.tp.control_group)
        return decode_step(data)
