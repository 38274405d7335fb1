"""Paged K/V addressing: token ``j`` of sequence ``b`` lives at
``k_pages[page_table[b, j // page_size], j % page_size]``."""

from __future__ import annotations

import torch


def gather_kv(pages: torch.Tensor, page_table: torch.Tensor, b: int, length: int) -> torch.Tensor:
    """Contiguous ``[length, Hkv, d]`` view-copy of sequence ``b``'s keys or values."""
    page_size = pages.shape[1]
    n_pages = -(-length // page_size)
    rows = pages[page_table[b, :n_pages].long()]  # [n_pages, page_size, Hkv, d]
    return rows.reshape(n_pages * page_size, *pages.shape[2:])[:length]


def paginate(
    seqs: list[torch.Tensor],
    page_size: int,
    *,
    generator: torch.Generator | None = None,
    spare_pages: int = 0,
    poison: float = float("nan"),
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scatter per-sequence ``[L_b, H, d]`` tensors into shuffled pages.

    Returns ``(pages [num_pages, page_size, H, d], page_table [B, max_pages] int32)``.
    Unused slots and spare pages hold ``poison`` so that a kernel reading outside a
    sequence shows up in the output. The page order is a random permutation (from
    ``generator``) so that tests exercise the page table.
    """
    if page_size < 1:
        raise ValueError(f"page_size: expected >= 1, got {page_size}")
    if not seqs:
        raise ValueError("seqs: expected at least one sequence")
    h, d = seqs[0].shape[1:]
    need = [-(-s.shape[0] // page_size) for s in seqs]
    num_pages = sum(need) + spare_pages
    device, dtype = seqs[0].device, seqs[0].dtype
    pages = torch.full((max(num_pages, 1), page_size, h, d), poison, dtype=dtype, device=device)
    perm = torch.randperm(max(num_pages, 1), generator=generator).to(device)
    table = torch.zeros((len(seqs), max(max(need), 1)), dtype=torch.int32, device=device)
    nxt = 0
    for b, s in enumerate(seqs):
        for i in range(need[b]):
            page = int(perm[nxt])
            nxt += 1
            chunk = s[i * page_size : (i + 1) * page_size]
            pages[page, : chunk.shape[0]] = chunk
            table[b, i] = page
    return pages, table


def contiguous_to_paged(
    x: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, L, H, d]`` -> pages in order (no shuffle, no copy when ``L % page_size == 0``)."""
    bsz, length, h, d = x.shape
    n_pages = -(-length // page_size)
    if n_pages * page_size != length:
        pad = x.new_zeros(bsz, n_pages * page_size - length, h, d)
        x = torch.cat([x, pad], dim=1)
    pages = x.reshape(bsz * n_pages, page_size, h, d)
    table = torch.arange(bsz * n_pages, dtype=torch.int32, device=x.device).reshape(bsz, n_pages)
    return pages, table
