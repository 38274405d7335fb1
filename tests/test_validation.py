"""Every bad input of SPEC.md raises ValueError naming the argument."""

import pytest
import torch

from kernels import SparseConfig, build_index, sparse_attention, sparse_prefill
from tests.helpers import make_batch


def good():
    b = make_batch([40, 7], [10, 0], num_qo_heads=4, num_kv_heads=2, head_dim=64, page_size=16, seed=0)
    return dict(q=b.q, k_pages=b.k_pages, v_pages=b.v_pages, page_table=b.page_table,
                cu_seqlens_q=b.cu_seqlens_q, seqlens_kv=b.seqlens_kv)


def call(**over):
    args = good()
    args.update(over)
    return sparse_prefill(**args, config=SparseConfig(), backend="reference")


def test_good_inputs_pass():
    out, lse = call()
    assert out.shape == (47, 4, 64)


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("alpha", -0.1, "alpha"),
        ("alpha", 1.5, "alpha"),
        ("alpha", "0.1", "alpha"),
        ("alpha", float("nan"), "alpha"),
        ("block_size", 96, "block_size"),
        ("block_size", 0, "block_size"),
        ("block_size", 128.0, "block_size"),
        ("sink_tokens", -1, "sink_tokens"),
        ("window_tokens", -5, "window_tokens"),
        ("mean_correction", 1, "mean_correction"),
        ("scale", 0.0, "scale"),
        ("scale", float("inf"), "scale"),
        ("num_splits", -1, "num_splits"),
    ],
)
def test_bad_config(field, value, match):
    with pytest.raises(ValueError, match=match):
        SparseConfig(**{field: value})


def test_config_is_frozen():
    cfg = SparseConfig()
    with pytest.raises(Exception):
        cfg.alpha = 0.5  # type: ignore[misc]


def _bad_inputs():
    g = good()
    q, kp, pt, cu, skv = g["q"], g["k_pages"], g["page_table"], g["cu_seqlens_q"], g["seqlens_kv"]
    return [
        ("q_dtype", dict(q=q.to(torch.int32)), "q"),
        ("q_not_tensor", dict(q=q.tolist()), "q"),
        ("k_dtype", dict(k_pages=kp.double()), "k_pages"),
        ("v_dtype", dict(v_pages=kp.half()), "v_pages"),
        ("q_rank", dict(q=q[None]), "q"),
        ("k_rank", dict(k_pages=kp[0]), "k_pages"),
        ("v_shape", dict(v_pages=kp[:, :8].contiguous()), "v_pages"),
        ("head_dim", dict(q=torch.randn(47, 4, 128)), "k_pages"),
        ("head_ratio", dict(q=torch.randn(47, 3, 64)), "query heads"),
        ("noncontig", dict(q=torch.randn(47, 4, 128)[..., ::2]), "q"),
        ("device", dict(k_pages=kp.to("meta"), v_pages=kp.to("meta")), "k_pages"),
        ("cu_decreasing", dict(cu_seqlens_q=torch.tensor([0, 40, 30], dtype=torch.int32)), "cu_seqlens_q"),
        ("cu_start", dict(cu_seqlens_q=torch.tensor([1, 41, 47], dtype=torch.int32)), "cu_seqlens_q"),
        ("cu_total", dict(cu_seqlens_q=torch.tensor([0, 40, 46], dtype=torch.int32)), "cu_seqlens_q"),
        ("cu_dtype", dict(cu_seqlens_q=cu.float()), "cu_seqlens_q"),
        ("cu_rank", dict(cu_seqlens_q=cu[None]), "cu_seqlens_q"),
        ("skv_len", dict(seqlens_kv=skv[:1]), "seqlens_kv"),
        ("skv_short", dict(seqlens_kv=torch.tensor([50, 6], dtype=torch.int32)), "seqlens_kv"),
        ("pt_rows", dict(page_table=pt[:1]), "page_table"),
        ("pt_cols", dict(page_table=pt[:, :1]), "page_table"),
        ("pt_range", dict(page_table=torch.where(pt == pt[0, 0], kp.shape[0], pt)), "page_table"),
        ("pt_negative", dict(page_table=torch.where(pt == pt[1, 0], -1, pt)), "page_table"),
        ("pt_dtype", dict(page_table=pt.float()), "page_table"),
    ]


@pytest.mark.parametrize("case", _bad_inputs(), ids=lambda c: c[0])
def test_bad_input_raises_value_error_naming_argument(case):
    _, over, match = case
    with pytest.raises(ValueError, match=match):
        call(**over)


def test_bad_config_type():
    with pytest.raises(ValueError, match="config"):
        sparse_prefill(**good(), config={"alpha": 0.1}, backend="reference")  # type: ignore[arg-type]


def test_bad_backend():
    with pytest.raises(ValueError, match="backend"):
        sparse_prefill(**good(), config=SparseConfig(), backend="cuda")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="backend"):
        build_index(**good(), config=SparseConfig(), backend="nope")  # type: ignore[arg-type]


def test_contiguous_call_validates():
    q = torch.randn(1, 10, 4, 64)
    k = torch.randn(1, 10, 2, 64)
    with pytest.raises(ValueError, match="k"):
        sparse_attention(q, k[:, :5], k[:, :5])
    with pytest.raises(ValueError, match="v"):
        sparse_attention(q, k, k[..., :32])
    with pytest.raises(ValueError, match="q"):
        sparse_attention(q[0], k, k)


def test_canonical_device(monkeypatch):
    from kernels._checks import canonical_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert canonical_device("cuda") == torch.device("cuda", 3)  # tensors report cuda:<index>
    assert canonical_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert canonical_device("cuda:1") == torch.device("cuda", 1)
    assert canonical_device("cpu") == torch.device("cpu")
    assert canonical_device(torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ValueError, match="device"):
        canonical_device("nonsense")
    with pytest.raises(ValueError, match="pool_device"):
        canonical_device(1.5, "pool_device")
