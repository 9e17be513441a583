"""Every request's block ids in one persistent int32 table, a row per request, kept across steps.

``KVCacheManager`` is the only writer: when it grows a request's blocks it appends the new ids
to that request's row, and when it frees them the row goes back for reuse. Nothing is rebuilt
per step: a step gathers the rows of the requests it runs (``gather``), one indexed copy, and
the attention backend derives the step's positions and slot mappings from that table and the
context lengths with vectorised ops (``attention.step_layout``)::

    row 0  [ 12  5 31  0  0 ]   request "a": 3 blocks
    row 1  [  7  8  0  0  0 ]   request "b": 2 blocks
    row 2  [  0  0  0  0  0 ]   free (its request finished)

Rows and columns grow by doubling when a new request or a longer one needs them.  Each row is
also kept as a Python list, for the per-request reads of every step (``ids``): reading a tensor
slice back into a list costs microseconds per request per step.
"""
from __future__ import annotations

import torch


class BlockTable:
    """A persistent ``[rows, max_blocks]`` int32 table of block ids (see the module docstring)."""

    def __init__(self, rows: int = 64, max_blocks: int = 64):
        self.table = torch.zeros((max(1, rows), max(1, max_blocks)), dtype=torch.int32)
        self._ids: dict[str, list[int]] = {}  # request id -> its row's block ids, as a list
        self._rows: dict[str, int] = {}
        self._free_rows = list(range(self.table.shape[0] - 1, -1, -1))

    def row(self, request_id: str) -> int | None:
        """The request's row, or None if it holds no blocks."""
        return self._rows.get(request_id)

    def append(self, request_id: str, block_ids: list[int]) -> None:
        """Append ``block_ids`` to the request's row (assigned on its first blocks)."""
        if not block_ids:
            return
        row = self._rows.get(request_id)
        if row is None:
            if not self._free_rows:
                self._grow(rows=2 * self.table.shape[0])
            row = self._rows[request_id] = self._free_rows.pop()
        ids = self._ids.setdefault(request_id, [])
        start, end = len(ids), len(ids) + len(block_ids)
        if end > self.table.shape[1]:
            self._grow(columns=max(end, 2 * self.table.shape[1]))
        self.table[row, start:end] = torch.tensor(block_ids, dtype=torch.int32)
        ids.extend(block_ids)

    def release(self, request_id: str) -> None:
        """Give the request's row back (its blocks were freed)."""
        row = self._rows.pop(request_id, None)
        if row is None:
            return
        self.table[row, : len(self._ids.pop(request_id))] = 0
        self._free_rows.append(row)

    def ids(self, request_id: str) -> list[int]:
        """The request's block ids (a copy of its list)."""
        ids = self._ids.get(request_id)
        return [] if ids is None else ids.copy()

    def row_ids(self, request_id: str) -> list[int]:
        """The request's block ids as the tensor row holds them (integrity checks and tests)."""
        row = self._rows.get(request_id)
        return [] if row is None else self.table[row, : len(self._ids[request_id])].tolist()

    @property
    def lengths(self) -> dict[str, int]:
        """Request id -> block ids written in its row (checks and tests)."""
        return {request_id: len(ids) for request_id, ids in self._ids.items()}

    def gather(self, rows: list[int], max_blocks: int) -> torch.Tensor:
        """The step's block table: ``rows`` in order, their first ``max_blocks`` columns (a copy)."""
        return torch.from_numpy(self.table.numpy()[rows, :max_blocks])  # numpy: a fancy index costs ~us there

    def _grow(self, rows: int | None = None, columns: int | None = None) -> None:
        old_rows, old_columns = self.table.shape
        rows, columns = rows or old_rows, columns or old_columns
        grown = torch.zeros((rows, columns), dtype=torch.int32)
        grown[:old_rows, :old_columns] = self.table
        self.table = grown
        self._free_rows[:0] = range(rows - 1, old_rows - 1, -1)
