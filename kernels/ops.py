"""Public entry points and backend dispatch (reference on CPU, Triton on GPU or under
``TRITON_INTERPRET=1``; the CUTLASS attention stage on GPU when its library is available)."""

from __future__ import annotations

import collections
import functools
import logging
import threading

import torch

from . import fp8, reference
from .backend import Backend, cutlass_available, resolve_backend, triton_available  # noqa: F401 (re-exported)
from ._checks import check_attention_inputs, check_finite_inputs, check_tensor, OPERATOR_DTYPES
from .config import SparseConfig
from .fp8 import Fp8Descales
from .index import SparseIndex
from .plan import PrefillPlan, make_plan

logger = logging.getLogger(__name__)

_ATTENTION_CALLS: collections.Counter[str] = collections.Counter()
_ATTENTION_CALLS_LOCK = threading.Lock()


def attention_kernel_calls() -> dict[str, int]:
    """Calls of the attention stage in this process (``attention_planned`` and every entry point
    built on it) by the kernel that ran: ``cutlass``, ``triton`` or ``reference``. What ``auto``
    chose is otherwise invisible to callers; replicas report these counts in their stats."""
    with _ATTENTION_CALLS_LOCK:
        return dict(_ATTENTION_CALLS)


def _count_attention(kernel: str) -> None:
    with _ATTENTION_CALLS_LOCK:
        _ATTENTION_CALLS[kernel] += 1


def plan_prefill(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_kv: torch.Tensor,
    config: SparseConfig | None = None,
    prompt_lens: object = None,
) -> PrefillPlan:
    """Validate inputs and metadata; returns the plan that ``run`` calls reuse.

    ``prompt_lens``: per sequence, the whole prompt's length when this batch is a chunk that
    does not end it (``config.last_dense_tiles`` counts the prompt's last tiles); ``None``:
    every sequence ends here."""
    config = SparseConfig() if config is None else config
    q, k_pages, v_pages = check_attention_inputs(q, k_pages, v_pages)
    plan = make_plan(
        cu_seqlens_q,
        seqlens_kv,
        page_table,
        num_qo_heads=q.shape[1],
        num_kv_heads=k_pages.shape[2],
        head_dim=q.shape[2],
        page_size=k_pages.shape[1],
        num_pages=k_pages.shape[0],
        config=config,
        device=q.device,
        prompt_lens=prompt_lens,
    )
    if plan.total_q != q.shape[0]:
        raise ValueError(
            f"cu_seqlens_q: expected the last offset to equal q.shape[0] = {q.shape[0]}, "
            f"got {plan.total_q}"
        )
    return plan


def check_inputs_finite(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PrefillPlan) -> None:
    """Opt-in input check: ValueError naming ``q``, ``k_pages`` or ``v_pages`` when a value the
    batch reads is NaN or infinite. Reads the inputs back (a host sync), so it is off in the
    entry points unless ``check_finite=True``; without it a NaN is contained as
    docs/SEMANTICS.md "Non-finite inputs" says."""
    check_finite_inputs(q, k_pages, v_pages, plan.page_table, plan.seqlens_kv)


def plan_descales(
    q: torch.Tensor, plan: PrefillPlan, q_descale=None, k_descale=None, v_descale=None,
    *, check_values: bool = True,
) -> Fp8Descales | None:
    """The validated descales of an FP8 batch (``None`` for 16/32-bit inputs, which must not
    pass any). ``check_values`` reads them back once to reject zero, negative or NaN."""
    if not fp8.is_fp8(q):
        fp8.reject_descales(q_descale, k_descale, v_descale, q.dtype)
        return None
    if plan.head_dim < 32:  # Hopper's fp8 MMA reduces over 32 elements at a time
        raise ValueError(f"q: FP8 inputs need head_dim >= 32, got {plan.head_dim}")
    return fp8.check_descales(
        q_descale, k_descale, v_descale, batch=plan.batch_size, num_kv_heads=plan.num_kv_heads,
        device=q.device, check_values=check_values,
    )


def _check_planned_descales(q: torch.Tensor, descales: Fp8Descales | None) -> None:
    if fp8.is_fp8(q) and descales is None:
        raise ValueError("descales: FP8 inputs need Fp8Descales (see kernels.ops.plan_descales), got None")
    if descales is not None and not fp8.is_fp8(q):
        raise ValueError(f"descales: only for float8_e4m3fn inputs, q is {q.dtype}")


def build_index_planned(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PrefillPlan,
    *, backend: Backend = "auto", descales: Fp8Descales | None = None, capacity: int | None = None,
) -> SparseIndex:
    """The index of ``plan``'s batch. ``capacity`` (Triton): ``kv_tiles`` entries to allocate
    instead of reading the exact count back (``triton_index.build_index``); at least
    ``plan.index_capacity`` never overflows, and then the call makes no host sync."""
    _check_planned_descales(q, descales)
    if resolve_backend(backend, q.device) in ("triton", "cutlass"):
        from . import triton_index

        return triton_index.build_index(q, k_pages, v_pages, plan, descales=descales, capacity=capacity)
    return reference.build_index(q, k_pages, v_pages, plan, descales=descales)


def attention_planned(
    q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, plan: PrefillPlan,
    index: SparseIndex, *, backend: Backend = "auto", descales: Fp8Descales | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_planned_descales(q, descales)
    resolved = resolve_backend(backend, q.device)
    if resolved == "cutlass" or (backend == "auto" and resolved == "triton"
                                 and _auto_cutlass(q, k_pages, v_pages)):
        from . import cutlass_attention  # forced: unsupported inputs raise ValueError

        kernel, attend = "cutlass", cutlass_attention.sparse_attention
    elif resolved == "triton":
        from . import triton_attention

        kernel, attend = "triton", triton_attention.sparse_attention
    else:
        kernel, attend = "reference", reference.sparse_attention
    out = attend(q, k_pages, v_pages, plan, index, descales=descales)
    _count_attention(kernel)
    return out


def _auto_cutlass(q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor) -> bool:
    """``auto`` takes the CUTLASS kernel whenever it supports the inputs and its library is
    available: prebuilt (``FLASHPREFILL_CUTLASS_LIB``), cached, or buildable here (nvcc and the
    CUTLASS headers; built once on first use, ~30 s, cached on disk). v1 is faster than the
    Triton kernel (1.47x at 128K, BENCHMARKS.md). A library that cannot be loaded (a failed
    build, an ABI mismatch) makes ``auto`` fall back to Triton for the rest of the process, with
    one warning; ``backend="cutlass"`` raises instead."""
    from . import cutlass_attention

    if not (cutlass_available(q.device) and cutlass_attention.supports(q, k_pages, v_pages)):
        return False
    return _cutlass_loads()


@functools.lru_cache(maxsize=None)
def _cutlass_loads() -> bool:
    from . import cutlass_build

    try:
        cutlass_build.load_library()
    except (RuntimeError, OSError) as exc:
        logger.warning("backend auto: the CUTLASS library is unavailable (%s); using Triton", exc)
        return False
    return True


def build_index(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_kv: torch.Tensor,
    config: SparseConfig | None = None,
    *,
    backend: Backend = "auto",
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    check_finite: bool = False,
    prompt_lens: object = None,
) -> SparseIndex:
    """Index stage on the paged layout: block means and the CSR of selected K/V tiles.
    ``check_finite``: raise ValueError on NaN/Inf inputs (a host sync; see ``check_inputs_finite``).
    ``prompt_lens``: as :func:`sparse_prefill`'s."""
    plan = plan_prefill(q, k_pages, v_pages, page_table, cu_seqlens_q, seqlens_kv, config, prompt_lens)
    if check_finite:
        check_inputs_finite(q, k_pages, v_pages, plan)
    descales = plan_descales(q, plan, q_descale, k_descale, v_descale)
    return build_index_planned(q, k_pages, v_pages, plan, backend=backend, descales=descales)


def sparse_prefill(
    q: torch.Tensor,
    k_pages: torch.Tensor,
    v_pages: torch.Tensor,
    page_table: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    seqlens_kv: torch.Tensor,
    config: SparseConfig | None = None,
    *,
    backend: Backend = "auto",
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    check_finite: bool = False,
    prompt_lens: object = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashPrefill V2 on the paged varlen layout.

    q: ``[Tq, Hq, d]``; k_pages, v_pages: ``[num_pages, page_size, Hkv, d]`` (V may be
    token-major: a permuted ``[num_pages, Hkv, d, page_size]`` tensor);
    page_table: ``[B, max_pages]`` int32; cu_seqlens_q: ``[B+1]``; seqlens_kv: ``[B]``
    (``>= Lq``: a cached prefix precedes the new tokens, causal alignment bottom-right).
    FP8: ``float8_e4m3fn`` q, k, v with float32 descales of shape ``()``/``[1]``, ``[Hkv]`` or
    ``[B, Hkv]`` (``kernels/fp8.py``).
    ``check_finite``: raise ValueError naming the tensor if a value the batch reads is NaN or
    infinite (reads the inputs back: a host sync). Off, a NaN is contained as
    docs/SEMANTICS.md "Non-finite inputs" says.
    ``prompt_lens``: per sequence, the whole prompt's length when this call prefills a chunk
    that does not end it (``config.last_dense_tiles`` counts the prompt's last tiles).
    Returns ``out [Tq, Hq, d]`` (q's dtype; bfloat16 for FP8) and ``lse [Tq, Hq]`` (float32,
    natural log).
    """
    plan = plan_prefill(q, k_pages, v_pages, page_table, cu_seqlens_q, seqlens_kv, config, prompt_lens)
    if check_finite:
        check_inputs_finite(q, k_pages, v_pages, plan)
    descales = plan_descales(q, plan, q_descale, k_descale, v_descale)
    index = build_index_planned(q, k_pages, v_pages, plan, backend=backend, descales=descales)
    return attention_planned(q, k_pages, v_pages, plan, index, backend=backend, descales=descales)


def prepare_contiguous(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: SparseConfig | None = None,
    *,
    page_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, PrefillPlan]:
    """Contiguous causal self-attention inputs ``q [B, L, Hq, d]``, ``k, v [B, L, Hkv, d]`` ->
    ``(q [B*L, Hq, d], k_pages, v_pages, plan)`` on the paged layout (pages in order, no copy
    when ``L % page_size == 0``)."""
    q = check_tensor("q", q, ndim=4, dtypes=OPERATOR_DTYPES)
    k = check_tensor("k", k, ndim=4, dtypes=(q.dtype,), device=q.device)
    v = check_tensor("v", v, ndim=4, dtypes=(q.dtype,), device=q.device)
    if k.shape != v.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if k.shape[:2] != q.shape[:2] or k.shape[3] != q.shape[3]:
        raise ValueError(
            f"k: expected shape [B={q.shape[0]}, L={q.shape[1]}, Hkv, d={q.shape[3]}] matching q, "
            f"got {tuple(k.shape)}"
        )
    from .paged import contiguous_to_paged

    bsz, length = q.shape[:2]
    k_pages, page_table = contiguous_to_paged(k, page_size)
    v_pages, _ = contiguous_to_paged(v, page_size)
    cu = torch.arange(0, (bsz + 1) * length, length, dtype=torch.int32, device=q.device)
    seqlens_kv = torch.full((bsz,), length, dtype=torch.int32, device=q.device)
    qf = q.reshape(bsz * length, *q.shape[2:])
    plan = plan_prefill(qf, k_pages, v_pages, page_table, cu, seqlens_kv, config)
    return qf, k_pages, v_pages, plan


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    config: SparseConfig | None = None,
    *,
    page_size: int = 64,
    backend: Backend = "auto",
    q_descale: torch.Tensor | None = None,
    k_descale: torch.Tensor | None = None,
    v_descale: torch.Tensor | None = None,
    check_finite: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal self-attention on contiguous ``[B, L, Hq, d]`` q and ``[B, L, Hkv, d]`` k, v
    (FP8 with descales and ``check_finite`` as in :func:`sparse_prefill`).

    Returns ``out [B, L, Hq, d]`` and ``lse [B, L, Hq]``.
    """
    qf, k_pages, v_pages, plan = prepare_contiguous(q, k, v, config, page_size=page_size)
    if check_finite:
        check_finite_inputs(qf, k_pages, v_pages, plan.page_table, plan.seqlens_kv, names=("q", "k", "v"))
    descales = plan_descales(qf, plan, q_descale, k_descale, v_descale)
    index = build_index_planned(qf, k_pages, v_pages, plan, backend=backend, descales=descales)
    out, lse = attention_planned(qf, k_pages, v_pages, plan, index, backend=backend, descales=descales)
    return out.reshape(q.shape), lse.reshape(q.shape[0], q.shape[1], q.shape[2])
