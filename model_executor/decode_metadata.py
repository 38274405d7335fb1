"""A decode step's batch metadata, kept on the device between steps.

A decode step's page table changes little from one step to the next: the same sequences run in
the same rows, and a row gains a page once every ``page_size`` tokens. So the eager decode step
(``ModelRunner.decode`` when no CUDA graph holds the batch) keeps persistent device buffers,
sized to the largest batch and page count seen (grown, never shrunk):

- the page table: a row is written only where its request or its pages changed (a new request
  in the row, or pages appended: only the new columns); a host mirror of each row (request id,
  pages) tells which;
- token ids and positions: one host-to-device copy of ``[2, B]`` per step (every row's change);
- KV lengths and slots: computed on the device from the positions and the page table.

Columns of a row past its pages hold stale page ids; nothing reads them (the decode kernel stops
at ``seqlens_kv``). The CUDA graphs (``model_executor/cuda_graphs.py``) keep their own static
buffers: a graph reads the addresses it was captured with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class DecodeMetadata:
    """Persistent decode metadata for one runner (see the module doc). ``stats``: steps
    prepared, page-table rows rewritten whole, page ids written, buffer reallocations."""

    def __init__(self, page_size: int, device: torch.device) -> None:
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size: expected an int >= 1, got {page_size!r}")
        self.page_size = page_size
        self.device = torch.device(device)
        self._rows = 0
        self._cols = 0
        self._mirror: list[tuple[str, list[int]] | None] = []
        self.stats = {"steps": 0, "rows_written": 0, "pages_written": 0, "resized": 0}

    @property
    def capacity(self) -> tuple[int, int]:
        """(rows, page-table columns) the buffers hold now."""
        return self._rows, self._cols

    def _ensure(self, batch: int, cols: int) -> None:
        if batch <= self._rows and cols <= self._cols:
            return
        # doubling: a batch or a sequence that keeps growing reallocates log-many times
        rows = self._rows if batch <= self._rows else max(batch, 2 * self._rows, 8)
        cols = self._cols if cols <= self._cols else max(cols, 2 * self._cols, 8)
        dev = self.device
        self._i64 = torch.zeros(2, rows, dtype=torch.int64, device=dev)  # token ids, positions
        self._seqlens = torch.ones(rows, dtype=torch.int32, device=dev)
        self._table = torch.zeros(rows, cols, dtype=torch.int32, device=dev)
        self._cu = torch.arange(rows + 1, dtype=torch.int32, device=dev)  # one new token per row
        self._rows, self._cols = rows, cols
        self._mirror = [None] * rows  # a fresh table: every row is written again
        self.stats["resized"] += 1

    def prepare(self, request_ids: Sequence[str], page_lists: Sequence[Sequence[int]], token_ids: torch.Tensor,
                starts: Sequence[int]) -> dict[str, torch.Tensor]:
        """The step of ``request_ids`` (row ``b``: pages ``page_lists[b]``, newest token
        ``token_ids[b]`` (int64, host) at position ``starts[b]``). Returns device views of the
        buffers, valid until the next call: ``input_ids``, ``positions`` (int64 ``[B]``),
        ``page_table`` (int32 ``[B, cols]``), ``cu_seqlens_q`` (``[B+1]``), ``seqlens_kv``
        (int32 ``[B]``), ``slots`` (int64 ``[B]``). The caller validated the inputs."""
        batch = len(request_ids)
        self._ensure(batch, max(len(p) for p in page_lists))
        rows: list[int] = []
        cols: list[int] = []
        pages: list[int] = []
        for r, (rid, held) in enumerate(zip(request_ids, page_lists)):
            seen = self._mirror[r]
            first = 0
            if seen is not None and seen[0] == rid and len(held) >= len(seen[1]) and held[: len(seen[1])] == seen[1]:
                first = len(seen[1])  # the same request, pages appended (or none)
                if first == len(held):
                    continue
            else:
                self.stats["rows_written"] += 1
            new = held[first:]
            rows.extend([r] * len(new))
            cols.extend(range(first, len(held)))
            pages.extend(new)
            self._mirror[r] = (rid, list(held))
        if pages:
            where = torch.tensor([rows, cols], dtype=torch.int64).to(self.device)
            self._table.index_put_((where[0], where[1]), torch.tensor(pages, dtype=torch.int32).to(self.device))
            self.stats["pages_written"] += len(pages)
        host = torch.stack([token_ids.to(torch.int64), torch.as_tensor(list(starts), dtype=torch.int64)])
        self._i64[:, :batch].copy_(host)
        pos = self._i64[1, :batch]
        table = self._table[:batch]
        seqlens = self._seqlens[:batch]
        seqlens.copy_(pos + 1)
        page_of = table.gather(1, torch.div(pos, self.page_size, rounding_mode="floor")[:, None])[:, 0]
        slots = page_of.to(torch.int64) * self.page_size + pos % self.page_size
        self.stats["steps"] += 1
        return {"input_ids": self._i64[0, :batch], "positions": pos, "page_table": table,
                "cu_seqlens_q": self._cu[: batch + 1], "seqlens_kv": seqlens, "slots": slots}


__all__ = ["DecodeMetadata"]
