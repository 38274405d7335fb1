"""Dense paged decode attention: one new query token per sequence against its paged K/V.

``q [B, Hq, d]`` holds the newest token of each sequence, whose own K/V is already written
to the pages (``seqlens_kv[b]`` counts it), so the token attends to all ``seqlens_kv[b]``
keys: no causal mask, no sparsity (SPEC.md, "Decode"). Same paged layout as prefill:
token ``j`` of sequence ``b`` at ``k_pages[page_table[b, j // page_size], j % page_size]``.

Returns ``out [B, Hq, d]`` in ``q.dtype`` and ``lse [B, Hq]`` float32 (natural log of the
softmax denominator), so that decode parts can be merged exactly with other attention parts.

Host syncs: ``paged_decode`` checks values (``seqlens_kv >= 1``, page table width and entries
in range) with one device->host copy when ``check_values=True`` (the default). The decode
loop, whose metadata is built by the KV pool, passes ``check_values=False`` and
``max_seqlen_kv`` (or ``num_splits``): the Triton path then never syncs and can be captured
in a CUDA graph.
"""

from __future__ import annotations

import torch

from . import fp8 as _fp8
from ._checks import FLOAT_DTYPES, bad_page_entries, check_attention_inputs, check_tensor, page_entry_error
from ._scalars import check_int as _check_int
from ._scalars import softmax_scale as _softmax_scale
from .backend import Backend, resolve_backend
from .paged import gather_kv

_INT_DTYPES = (torch.int32, torch.int64)
MAX_SPLITS = 1024  # split-KV parts per sequence; far past any useful count, well inside grid limits


def check_decode_inputs(
    q: object,
    k_pages: object,
    v_pages: object,
    page_table: object,
    seqlens_kv: object,
    *,
    check_values: bool = True,
    k_descale: object = None,
    v_descale: object = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, tuple | None]:
    """Shapes, dtypes and devices (no sync); with ``check_values`` also the values of
    ``seqlens_kv`` and ``page_table`` and the descales (one device->host copy each).
    FP8 pages: ``q`` stays in its float dtype, ``k_descale``/``v_descale`` are required; returns them as
    ``[B, Hkv]`` views (else ``None``)."""
    q = check_tensor("q", q, ndim=3, dtypes=FLOAT_DTYPES)
    descales = None
    if _fp8.is_fp8(k_pages):
        # [B, Hq, d] has the rank of the prefill's [Tq, Hq, d]: share its rules
        q, k_pages, v_pages = check_attention_inputs(q, k_pages, v_pages, kv_dtype=_fp8.FP8_DTYPE)
        named = [(name, _fp8.descale_view(name, t, q.shape[0], k_pages.shape[2], q.device))
                 for name, t in (("k_descale", k_descale), ("v_descale", v_descale))]
        if check_values:
            _fp8.check_descale_values(named)
        descales = (named[0][1], named[1][1])
    else:
        q, k_pages, v_pages = check_attention_inputs(q, k_pages, v_pages)
        for name, t in (("k_descale", k_descale), ("v_descale", v_descale)):
            if t is not None:
                raise ValueError(f"{name}: descale factors are only for float8_e4m3fn pages, got {k_pages.dtype} pages")
    batch = q.shape[0]
    seqlens_kv = check_tensor("seqlens_kv", seqlens_kv, ndim=1, dtypes=_INT_DTYPES, device=q.device)
    page_table = check_tensor("page_table", page_table, ndim=2, dtypes=_INT_DTYPES, device=q.device)
    if seqlens_kv.shape[0] != batch:
        raise ValueError(f"seqlens_kv: expected {batch} entries (q.shape[0]), got {seqlens_kv.shape[0]}")
    if page_table.shape[0] != batch:
        raise ValueError(f"page_table: expected {batch} rows (q.shape[0]), got {page_table.shape[0]}")
    if batch and page_table.shape[1] < 1:
        raise ValueError(f"page_table: expected at least one column, got shape {tuple(page_table.shape)}")
    if check_values and batch:
        _check_metadata_values(page_table, seqlens_kv, page_size=k_pages.shape[1], num_pages=k_pages.shape[0])
    return q, k_pages, v_pages, page_table, seqlens_kv, descales


def _check_metadata_values(
    page_table: torch.Tensor, seqlens_kv: torch.Tensor, *, page_size: int, num_pages: int
) -> None:
    lens = seqlens_kv.long()
    need = (lens + page_size - 1) // page_size  # pages used per sequence
    bad_entry = bad_page_entries(page_table, need, num_pages)
    # one device->host copy for every value check
    summary = torch.stack(
        [
            lens.min(),
            lens.argmin(),
            need.max(),
            lens.argmax(),
            bad_entry.flatten().int().argmax(),
            bad_entry.any().long(),
        ]
    ).tolist()
    min_len, argmin_len, max_need, argmax_len, first_bad, any_bad = summary
    if min_len < 1:
        raise ValueError(
            f"seqlens_kv: expected every length >= 1 (the new token's K/V is in the pages), "
            f"got seqlens_kv[{argmin_len}] = {min_len}"
        )
    if max_need > page_table.shape[1]:
        raise ValueError(
            f"page_table: expected at least {max_need} columns for seqlens_kv[{argmax_len}] with "
            f"page_size {page_size}, got {page_table.shape[1]}"
        )
    if any_bad:
        raise page_entry_error(page_table, *divmod(first_bad, page_table.shape[1]), num_pages)


def _reference_run(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seqlens_kv: torch.Tensor,
    scale: float,
    descales: tuple | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    batch, hq, d = q.shape
    hkv = k_pages.shape[2]
    g = hq // hkv
    out = torch.zeros(batch, hq, d, dtype=torch.float32, device=q.device)
    lse = torch.zeros(batch, hq, dtype=torch.float32, device=q.device)
    for b, length in enumerate(seqlens_kv.tolist()):
        keys = gather_kv(k_pages, page_table, b, length).float()  # [L, Hkv, d]
        vals = gather_kv(v_pages, page_table, b, length).float()
        if descales is not None:
            keys = _fp8.dequantize_sequence(keys, descales[0][b])
            vals = _fp8.dequantize_sequence(vals, descales[1][b])
        qb = q[b].float().view(hkv, g, d)
        s = scale * torch.einsum("hgd,lhd->hgl", qb, keys)  # [Hkv, g, L]: one row per query head
        row_lse = torch.logsumexp(s, dim=-1, keepdim=True)
        p = torch.exp(s - row_lse)
        out[b] = torch.einsum("hgl,lhd->hgd", p, vals).reshape(hq, d)
        lse[b] = row_lse.reshape(hq)
    return out.to(q.dtype), lse


def paged_decode_reference(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seqlens_kv: torch.Tensor,
    *,
    scale: float | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 reference, one sequence at a time (``[Hq, L]`` scores, never ``L x L``).

    Validates like ``paged_decode``. Returns ``out [B, Hq, d]`` (q.dtype), ``lse [B, Hq]`` fp32.
    """
    q, k_pages, v_pages, page_table, seqlens_kv, descales = check_decode_inputs(
        q, k_pages, v_pages, page_table, seqlens_kv, k_descale=k_descale, v_descale=v_descale
    )
    return _reference_run(q, k_pages, v_pages, page_table, seqlens_kv,
                          _softmax_scale(scale, q.shape[-1]), descales)


def paged_decode(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    seqlens_kv: torch.Tensor,
    *,
    scale: float | None = None,
    num_splits: int = 0,
    max_seqlen_kv: int | None = None,
    check_values: bool = True,
    backend: Backend = "auto",
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense decode attention over the paged K/V.

    q: ``[B, Hq, d]`` (fp16, bf16, fp32), one new token per sequence; k_pages, v_pages:
    ``[num_pages, page_size, Hkv, d]`` in q's dtype; page_table: ``[B, max_pages]`` int32
    (or int64); seqlens_kv: ``[B]`` keys per sequence, new token included (``>= 1``).
    scale: softmax scale, default ``1/sqrt(d)``.
    num_splits: split-KV parts per sequence (flash-decoding); 0 picks from the batch size and
    ``max_seqlen_kv`` (or, without it, the page table's width: no host sync), 1 disables.
    max_seqlen_kv: host-known upper bound of ``seqlens_kv``, only used to choose num_splits.
    check_values: validate the values of ``seqlens_kv`` and ``page_table`` (one host sync);
    pass False in a loop whose metadata is known good (the KV pool builds it).
    FP8 pages (``float8_e4m3fn``, V row-major or token-major) with a float ``q`` need
    ``k_descale``/``v_descale`` (float32, ``()``/``[1]``, ``[Hkv]`` or ``[B, Hkv]``).
    Returns ``out [B, Hq, d]`` in q's dtype and ``lse [B, Hq]`` float32 (natural log).
    """
    q, k_pages, v_pages, page_table, seqlens_kv, descales = check_decode_inputs(
        q, k_pages, v_pages, page_table, seqlens_kv, check_values=check_values,
        k_descale=k_descale, v_descale=v_descale,
    )
    softmax_scale = _softmax_scale(scale, q.shape[-1])
    _check_int("num_splits", num_splits, minimum=0)
    if num_splits > MAX_SPLITS:
        raise ValueError(f"num_splits: expected at most {MAX_SPLITS} (0 picks automatically), got {num_splits}")
    if max_seqlen_kv is not None:
        _check_int("max_seqlen_kv", max_seqlen_kv, minimum=1)
    if not isinstance(check_values, bool):
        raise ValueError(f"check_values: expected a bool, got {check_values!r}")
    backend = resolve_backend(backend, q.device)
    if q.shape[0] == 0:
        return (
            q.new_empty(q.shape),
            torch.empty(0, q.shape[1], dtype=torch.float32, device=q.device),
        )
    if backend in ("triton", "cutlass"):  # the CUTLASS backend has no decode kernel: Triton's
        from . import triton_decode

        return triton_decode.paged_decode(
            q, k_pages, v_pages, page_table, seqlens_kv,
            scale=softmax_scale, num_splits=num_splits, max_seqlen_kv=max_seqlen_kv,
            k_descale=None if descales is None else descales[0],
            v_descale=None if descales is None else descales[1],
        )
    return _reference_run(q, k_pages, v_pages, page_table, seqlens_kv, softmax_scale, descales)
