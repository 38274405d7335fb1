"""Host-side validation of user input (tensors, devices, page tables). Every failure is a ValueError
naming the argument; the scalar checks are in ``kernels/_scalars.py``."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# what the prefill operator takes: the float dtypes and e4m3 (with descales, kernels/fp8.py)
OPERATOR_DTYPES = FLOAT_DTYPES + (torch.float8_e4m3fn,)


def canonical_device(device: object, name: str = "device") -> torch.device:
    """``device`` as a ``torch.device``, an index-less ``cuda`` made ``cuda:<current>``: tensors
    report the indexed form, and ``torch.device("cuda") != torch.device("cuda:0")``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{name}: expected a torch device or its name, got {device!r}") from exc
    if dev.type == "cuda" and dev.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return dev


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in dtypes:
        want = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name}: expected dtype in ({want}), got {str(t.dtype).replace('torch.', '')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: expected a tensor on {device}, got one on {t.device}")
    return t


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(
            f"{name}: expected the last dimension contiguous (stride 1), got strides {t.stride()}; "
            "call .contiguous() first"
        )


def check_attention_inputs(
    q: object, k_pages: object, v_pages: object, *, kv_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [Tq, Hq, d], k_pages/v_pages [num_pages, page_size, Hkv, d] on one device, the pages
    in q's dtype (or ``kv_dtype``: decode reads FP8 pages with a 16/32-bit query)."""
    q = check_tensor("q", q, ndim=3, dtypes=OPERATOR_DTYPES)
    want = (q.dtype if kv_dtype is None else kv_dtype,)
    k_pages = check_tensor("k_pages", k_pages, ndim=4, dtypes=want, device=q.device)
    v_pages = check_tensor("v_pages", v_pages, ndim=4, dtypes=want, device=q.device)
    if tuple(v_pages.shape) != tuple(k_pages.shape):
        raise ValueError(
            f"v_pages: expected the shape of k_pages {tuple(k_pages.shape)}, got {tuple(v_pages.shape)}"
        )
    d = q.shape[2]
    if d not in (64, 128, 256) and not (d % 16 == 0 and 16 <= d <= 256):
        raise ValueError(f"q: expected head_dim a multiple of 16 in [16, 256], got {d}")
    if k_pages.shape[3] != d:
        raise ValueError(f"k_pages: expected head_dim {d} (from q), got {k_pages.shape[3]}")
    hq, hkv = q.shape[1], k_pages.shape[2]
    if hkv == 0 or hq == 0 or hq % hkv:
        raise ValueError(
            f"q: expected the number of query heads ({hq}) to be a positive multiple of "
            f"the number of KV heads ({hkv}, k_pages.shape[2])"
        )
    if k_pages.shape[1] < 1:
        raise ValueError(f"k_pages: expected page_size >= 1, got shape {tuple(k_pages.shape)}")
    for name, t in (("q", q), ("k_pages", k_pages)):
        check_last_dim_contiguous(name, t)
    if v_pages.numel() and v_pages.stride(-1) != 1 and v_pages.stride(1) != 1:
        raise ValueError(
            f"v_pages: expected the last dimension contiguous, or the slot dimension (token-major "
            f"V, a permuted [num_pages, Hkv, d, page_size] tensor), got strides {v_pages.stride()}"
        )
    return q, k_pages, v_pages


def bad_page_entries(page_table: torch.Tensor, pages_needed: torch.Tensor, num_pages: int) -> torch.Tensor:
    """Bool ``[B, max_pages]``: entries a sequence uses (``col < pages_needed[b]``) that point
    outside ``[0, num_pages)``. No sync: the caller reads it together with its other checks."""
    cols = torch.arange(page_table.shape[1], device=page_table.device)
    used = cols[None, :] < pages_needed.to(page_table.device)[:, None]
    return used & ((page_table < 0) | (page_table >= num_pages))


def page_entry_error(page_table: torch.Tensor, b: int, c: int, num_pages: int) -> ValueError:
    return ValueError(
        f"page_table: entry [{b}, {c}] = {int(page_table[b, c])} is out of range [0, {num_pages})"
    )


def _first_non_finite(x: torch.Tensor) -> tuple[int, ...] | None:
    bad = ~torch.isfinite(x.float() if x.element_size() == 1 else x)
    if not bool(bad.any()):
        return None
    return tuple(int(i) for i in bad.nonzero()[0].tolist())


def check_finite_inputs(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, page_table: torch.Tensor,
    seqlens_kv: tuple[int, ...], *, names: tuple[str, str, str] = ("q", "k_pages", "v_pages"),
) -> None:
    """ValueError naming ``q``, ``k_pages`` or ``v_pages`` if a value the batch reads is NaN or
    infinite (only the first ``seqlens_kv[b]`` tokens of each sequence's pages: unused slots
    may hold anything). Opt-in (``check_finite=True``): it reads every input back (host sync)."""
    where = _first_non_finite(q)
    if where is not None:
        raise ValueError(
            f"{names[0]}: expected finite values, got {float(q[where].float())} at [token {where[0]}, "
            f"head {where[1]}, dim {where[2]}]"
        )
    page_size = k_pages.shape[1]
    for name, pages in ((names[1], k_pages), (names[2], v_pages)):
        for b, length in enumerate(seqlens_kv):
            if length == 0:
                continue
            n_pages = -(-length // page_size)
            rows = pages[page_table[b, :n_pages].long()]  # [n_pages, page_size, Hkv, d]
            rows = rows.reshape(n_pages * page_size, *pages.shape[2:])[:length]
            where = _first_non_finite(rows)
            if where is not None:
                raise ValueError(
                    f"{name}: expected finite values in the tokens the batch reads, got "
                    f"{float(rows[where].float())} at sequence {b}, token {where[0]}, KV head "
                    f"{where[1]}, dim {where[2]}"
                )
