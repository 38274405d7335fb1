"""Dense paged decode: Triton kernel vs the fp32 reference vs an independent dense softmax,
split-KV invariance, every bad input, and a 32K GPU check."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.decode import paged_decode, paged_decode_reference
from kernels.ops import triton_available
from kernels.paged import paginate

CPU = torch.device("cpu")
needs_triton = pytest.mark.skipif(
    not triton_available(CPU), reason="Triton on CPU needs TRITON_INTERPRET=1"
)


def make_decode(
    seqlens: list[int], *, num_kv_heads: int, group: int, head_dim: int, page_size: int,
    seed: int, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
):
    """Random q and per-sequence keys/values, scattered into shuffled NaN-poisoned pages."""
    gen = torch.Generator().manual_seed(seed)
    hq = num_kv_heads * group
    q = torch.randn(len(seqlens), hq, head_dim, generator=gen)
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seqlens]
    values = [torch.randn(n, num_kv_heads, head_dim, generator=gen) for n in seqlens]
    perm_seed = seed + 1000
    k_pages, table = paginate([k.to(dtype) for k in keys], page_size,
                              generator=torch.Generator().manual_seed(perm_seed), spare_pages=2)
    v_pages, table_v = paginate([v.to(dtype) for v in values], page_size,
                                generator=torch.Generator().manual_seed(perm_seed), spare_pages=2)
    assert torch.equal(table, table_v)
    seqlens_kv = torch.tensor(seqlens, dtype=torch.int32)
    return dict(
        q=q.to(dtype).to(device), k_pages=k_pages.to(device), v_pages=v_pages.to(device),
        page_table=table.to(device), seqlens_kv=seqlens_kv.to(device),
    ), keys, values


def dense_decode(q, keys, values, *, dtype=torch.float32, scale=None):
    """Independent oracle: per sequence, expand K/V to every query head, softmax in ``dtype``."""
    hq, d = q.shape[1], q.shape[2]
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    outs, lses = [], []
    for b, (k, v) in enumerate(zip(keys, values)):
        g = hq // k.shape[1]
        kk = k.to(q.device, dtype).repeat_interleave(g, dim=1).transpose(0, 1)  # [Hq, L, d]
        vv = v.to(q.device, dtype).repeat_interleave(g, dim=1).transpose(0, 1)
        qb = q[b].to(dtype)[:, None, :]  # [Hq, 1, d]
        s = (qb @ kk.transpose(1, 2)) * scale  # [Hq, 1, L]
        outs.append((torch.softmax(s, dim=-1) @ vv)[:, 0])
        lses.append(torch.logsumexp(s.float(), dim=-1)[:, 0])
    return torch.stack(outs), torch.stack(lses)


SEQLENS = [1, 77, 200]  # a single-token sequence, odd lengths, several 64-key tiles


# ---------------------------------------------------------------- reference itself
def test_reference_matches_dense():
    args, keys, values = make_decode(SEQLENS, num_kv_heads=2, group=4, head_dim=64, page_size=16, seed=0)
    out, lse = paged_decode_reference(**args)
    d_out, d_lse = dense_decode(args["q"], keys, values)
    assert out.shape == (3, 8, 64) and out.dtype == torch.float32
    assert lse.shape == (3, 8) and lse.dtype == torch.float32
    assert (out - d_out).abs().max() < 1e-5
    assert (lse - d_lse).abs().max() < 1e-5


def test_reference_backend_and_scale():
    args, keys, values = make_decode([5, 130], num_kv_heads=1, group=2, head_dim=64, page_size=64, seed=1)
    out, lse = paged_decode(**args, scale=0.3, backend="reference")
    d_out, d_lse = dense_decode(args["q"], keys, values, scale=0.3)
    assert (out - d_out).abs().max() < 1e-5
    assert (lse - d_lse).abs().max() < 1e-5


def test_single_key_returns_its_value():
    args, _, values = make_decode([1, 1], num_kv_heads=2, group=2, head_dim=64, page_size=1, seed=2)
    out, _ = paged_decode_reference(**args)
    expect = torch.stack([v[0].repeat_interleave(2, dim=0) for v in values])
    assert torch.allclose(out, expect, atol=1e-6)


# ---------------------------------------------------------------- Triton, fp32
@needs_triton
@pytest.mark.parametrize("page_size", [1, 16, 64, 256])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_triton_fp32(group, head_dim, page_size):
    args, keys, values = make_decode(
        SEQLENS, num_kv_heads=2, group=group, head_dim=head_dim, page_size=page_size,
        seed=10 * group + head_dim + page_size,
    )
    ref_out, ref_lse = paged_decode_reference(**args)
    d_out, d_lse = dense_decode(args["q"], keys, values)
    out1, lse1 = paged_decode(**args, num_splits=1, backend="triton")
    out3, lse3 = paged_decode(**args, num_splits=3, backend="triton")
    for out, lse in ((out1, lse1), (out3, lse3)):
        assert out.dtype == torch.float32 and lse.dtype == torch.float32
        assert (out - ref_out).abs().max() <= 1e-4
        assert (out - d_out).abs().max() <= 1e-4
        assert (lse - ref_lse).abs().max() <= 1e-3
        assert (lse - d_lse).abs().max() <= 1e-3
    # split-KV merges exactly (up to fp32 rounding)
    assert (out1 - out3).abs().max() <= 1e-5
    assert (lse1 - lse3).abs().max() <= 1e-5


# ---------------------------------------------------------------- Triton, 16-bit
_LOWPREC = [
    (g, d, ps, torch.bfloat16) for g in (1, 4, 8) for d in (64, 128) for ps in (16, 64)
] + [(4, 128, 16, torch.float16), (8, 64, 64, torch.float16)]


@needs_triton
@pytest.mark.parametrize("group,head_dim,page_size,dtype", _LOWPREC)
def test_triton_lowprec(group, head_dim, page_size, dtype):
    args, keys, values = make_decode(
        SEQLENS, num_kv_heads=2, group=group, head_dim=head_dim, page_size=page_size,
        seed=7 * group + head_dim + page_size, dtype=dtype,
    )
    # the oracle sees the same rounded inputs
    keys = [k.to(dtype).float() for k in keys]
    values = [v.to(dtype).float() for v in values]
    ref_out, ref_lse = dense_decode(args["q"].float(), keys, values)
    low_out, _ = dense_decode(args["q"], keys, values, dtype=dtype)  # plain torch in 16 bits
    tol = 2 * (low_out.float() - ref_out).abs().max().item() + 1e-3
    pr_out, pr_lse = paged_decode_reference(**args)
    for splits in (1, 4):
        out, lse = paged_decode(**args, num_splits=splits, backend="triton")
        assert out.dtype == dtype
        assert (out.float() - ref_out).abs().max() <= tol, splits
        assert (lse - ref_lse).abs().max() <= 1e-3, splits
        assert (lse - pr_lse).abs().max() <= 1e-3, splits
    assert (pr_out.float() - ref_out).abs().max() <= tol


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
def test_split_counts_agree(num_splits):
    """More splits than tiles (empty splits) included; page_size 48 is not a divisor of 64."""
    args, keys, values = make_decode([300, 1, 64, 65], num_kv_heads=2, group=4, head_dim=64,
                                     page_size=48, seed=3)
    ref_out, ref_lse = paged_decode_reference(**args)
    out, lse = paged_decode(**args, num_splits=num_splits, backend="triton")
    assert (out - ref_out).abs().max() <= 1e-4
    assert (lse - ref_lse).abs().max() <= 1e-4


@needs_triton
def test_auto_splits_and_int64_metadata():
    args, _, _ = make_decode([200, 3], num_kv_heads=2, group=4, head_dim=64, page_size=16, seed=4)
    ref_out, ref_lse = paged_decode_reference(**args)
    args64 = dict(args, page_table=args["page_table"].long(), seqlens_kv=args["seqlens_kv"].long())
    for kwargs in ({}, {"max_seqlen_kv": 200}, {"check_values": False, "max_seqlen_kv": 200}):
        for a in (args, args64):
            out, lse = paged_decode(**a, backend="triton", **kwargs)
            assert (out - ref_out).abs().max() <= 1e-4
            assert (lse - ref_lse).abs().max() <= 1e-4


@needs_triton
def test_strided_views():
    """q with a padded head stride and layer views of a bigger pool tensor."""
    args, keys, values = make_decode([90, 33], num_kv_heads=2, group=4, head_dim=64, page_size=16, seed=5)
    q_big = torch.randn(2, 8, 96)
    q_big[:, :, :64] = args["q"]
    q = q_big[:, :, :64]
    k_layers = torch.stack([torch.zeros_like(args["k_pages"]), args["k_pages"]])
    v_layers = torch.stack([args["v_pages"], torch.zeros_like(args["v_pages"])])
    view_args = dict(args, q=q, k_pages=k_layers[1], v_pages=v_layers[0])
    ref_out, ref_lse = paged_decode_reference(**args)
    for splits in (1, 3):
        out, lse = paged_decode(**view_args, num_splits=splits, backend="triton")
        assert (out - ref_out).abs().max() <= 1e-4
        assert (lse - ref_lse).abs().max() <= 1e-4


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=needs_triton)])
def test_empty_batch(backend):
    q = torch.empty(0, 8, 64)
    pages = torch.zeros(4, 16, 2, 64)
    out, lse = paged_decode(q, pages, pages, torch.zeros(0, 1, dtype=torch.int32),
                            torch.zeros(0, dtype=torch.int32), backend=backend)
    assert out.shape == (0, 8, 64) and lse.shape == (0, 8) and lse.dtype == torch.float32


# ---------------------------------------------------------------- bad input
def good():
    args, _, _ = make_decode([20, 7], num_kv_heads=2, group=2, head_dim=64, page_size=16, seed=6)
    return args


def _bad_cases():
    a = good()
    q, kp, vp, pt, sl = a["q"], a["k_pages"], a["v_pages"], a["page_table"], a["seqlens_kv"]
    num_pages = kp.shape[0]
    pt_high = pt.clone()
    pt_high[1, 0] = num_pages
    pt_neg = pt.clone()
    pt_neg[0, 1] = -1
    return [
        ("q", dict(q=q.numpy()), "q"),
        ("q_dtype", dict(q=q.to(torch.int32)), "q"),
        ("q_rank", dict(q=q[None]), "q"),
        ("q_heads", dict(q=q[:, :3]), "q"),
        ("q_head_dim", dict(q=q[..., :48].contiguous()), "k_pages"),
        ("q_lastdim", dict(q=q.transpose(1, 2).contiguous().transpose(1, 2)), "q"),
        ("k_dtype", dict(k_pages=kp.double()), "k_pages"),
        ("k_rank", dict(k_pages=kp[0]), "k_pages"),
        ("v_shape", dict(v_pages=vp[:-1]), "v_pages"),
        ("v_dtype", dict(v_pages=vp.half()), "v_pages"),
        ("k_lastdim", dict(k_pages=kp.transpose(2, 3).contiguous().transpose(2, 3),
                           v_pages=vp.transpose(2, 3).contiguous().transpose(2, 3)), "k_pages"),
        ("pt_dtype", dict(page_table=pt.float()), "page_table"),
        ("pt_rank", dict(page_table=pt[0]), "page_table"),
        ("pt_rows", dict(page_table=pt[:1]), "page_table"),
        ("pt_width", dict(page_table=pt[:, :1]), "page_table"),
        ("pt_high", dict(page_table=pt_high), "page_table"),
        ("pt_negative", dict(page_table=pt_neg), "page_table"),
        ("sl_dtype", dict(seqlens_kv=sl.float()), "seqlens_kv"),
        ("sl_rank", dict(seqlens_kv=sl[None]), "seqlens_kv"),
        ("sl_len", dict(seqlens_kv=sl[:1]), "seqlens_kv"),
        ("sl_zero", dict(seqlens_kv=torch.tensor([20, 0], dtype=torch.int32)), "seqlens_kv"),
        ("sl_negative", dict(seqlens_kv=torch.tensor([-3, 7], dtype=torch.int32)), "seqlens_kv"),
        ("scale_zero", dict(scale=0.0), "scale"),
        ("scale_nan", dict(scale=float("nan")), "scale"),
        ("scale_str", dict(scale="0.1"), "scale"),
        ("splits_negative", dict(num_splits=-1), "num_splits"),
        ("splits_float", dict(num_splits=2.0), "num_splits"),
        ("splits_huge", dict(num_splits=5000), "num_splits"),
        ("max_seqlen", dict(max_seqlen_kv=0), "max_seqlen_kv"),
        ("check_values", dict(check_values=1), "check_values"),
        ("backend", dict(backend="cuda"), "backend"),
    ]


@pytest.mark.parametrize("case", _bad_cases(), ids=lambda c: c[0])
def test_bad_input_raises(case):
    _, over, match = case
    args = good()
    args.update(over)
    args.setdefault("backend", "reference")
    with pytest.raises(ValueError, match=match):
        paged_decode(**args)


_TENSOR_ARGS = {"q", "k_pages", "v_pages", "page_table", "seqlens_kv"}


@pytest.mark.parametrize("case", [c for c in _bad_cases() if set(c[1]) <= _TENSOR_ARGS], ids=lambda c: c[0])
def test_reference_validates_too(case):
    _, over, match = case
    args = good()
    args.update(over)
    with pytest.raises(ValueError, match=match):
        paged_decode_reference(**args)


def test_triton_backend_needs_cuda_or_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="backend"):
        paged_decode(**good(), backend="triton")


def test_device_mismatch_raises():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device type")
    args = good()
    args["page_table"] = args["page_table"].cuda()
    with pytest.raises(ValueError, match="page_table"):
        paged_decode(**args)


# ---------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [64, 16])
def test_gpu_32k(page_size):
    seqlens = [32768, 32768 - 1000, 1, 4097]
    args, keys, values = make_decode(
        seqlens, num_kv_heads=8, group=4, head_dim=128, page_size=page_size, seed=7,
        dtype=torch.bfloat16, device="cuda",
    )
    keys = [k.to(torch.bfloat16).float() for k in keys]
    values = [v.to(torch.bfloat16).float() for v in values]
    ref_out, ref_lse = dense_decode(args["q"].float(), keys, values)
    low_out, _ = dense_decode(args["q"], keys, values, dtype=torch.bfloat16)
    tol = 2 * (low_out.float() - ref_out).abs().max().item() + 1e-3
    pr_out, pr_lse = paged_decode_reference(**args)
    assert (pr_lse - ref_lse).abs().max() <= 1e-3
    for kwargs in ({}, {"num_splits": 1}, {"num_splits": 7}, {"max_seqlen_kv": 32768, "check_values": False}):
        out, lse = paged_decode(**args, **kwargs)  # auto backend -> triton on CUDA
        torch.cuda.synchronize()
        assert out.dtype == torch.bfloat16 and out.is_cuda
        assert (out.float() - ref_out).abs().max() <= tol, kwargs
        assert (lse - ref_lse).abs().max() <= 1e-3, kwargs
