"""Structured synthetic inputs (calibration against the reference index) and fidelity metrics."""

import math

import pytest
import torch

from kernels import SparseConfig, reference
from kernels.fidelity import fidelity_report, index_density, needle_recall, prepare_paged
from kernels.synthetic import PAPER_DENSITY, paper_density, structured_inputs, structured_qkv
from tests.helpers import make_batch

SMALL = dict(num_qo_heads=8, num_kv_heads=2, head_dim=64, device="cpu")


def _reference_index(x, config=None):
    q, k_pages, v_pages, plan = prepare_paged(x.q, x.k, x.v, config)
    return reference.build_index(q, k_pages, v_pages, plan), plan


def test_paper_density_table_and_interpolation():
    for n, d in PAPER_DENSITY:
        assert paper_density(n) == pytest.approx(d)
    # geometric mean between neighbours: log-log linear
    assert paper_density(int(math.sqrt(4096 * 8192))) == pytest.approx(math.sqrt(0.760 * 0.542), rel=1e-3)
    lengths = [1024, 2048, 3000, 4096, 6000, 12000, 50000, 131072, 262144, 1 << 20]
    values = [paper_density(n) for n in lengths]
    assert all(0 < v <= 1 for v in values)
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert paper_density(1024) == 1.0


def test_deterministic_per_seed():
    a = structured_inputs(1024, seed=3, **SMALL)
    b = structured_inputs(1024, seed=3, **SMALL)
    c = structured_inputs(1024, seed=4, **SMALL)
    for x, y in ((a.q, b.q), (a.k, b.k), (a.v, b.v), (a.needle_blocks, b.needle_blocks)):
        assert torch.equal(x, y)
    assert a.stripe_blocks == b.stripe_blocks
    assert not torch.equal(a.q, c.q) and not torch.equal(a.k, c.k)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_shapes_and_dtypes(dtype):
    q, k, v = structured_qkv(1000, batch=2, num_qo_heads=6, num_kv_heads=2, head_dim=32,
                             dtype=dtype, device="cpu")
    assert q.shape == (2, 1000, 6, 32) and k.shape == v.shape == (2, 1000, 2, 32)
    assert q.dtype == k.dtype == v.dtype == dtype
    assert all(torch.isfinite(t.float()).all() for t in (q, k, v))
    x = structured_inputs(2048, batch=2, **SMALL)
    nb = x.needle_blocks
    assert nb.dtype == torch.int64 and nb.dim() == 2 and nb.shape[1] == 6 and nb.shape[0] > 0
    assert set(nb[:, 0].tolist()) == {0, 1}
    b, h, ks, ke, qs, qe = nb.unbind(1)
    assert bool(((h >= 0) & (h < 2) & (ks < ke) & (qs < qe) & (ke - 1 + 512 < qs)).all())


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(seqlen=0), "seqlen"),
        (dict(num_qo_heads=6, num_kv_heads=4), "num_qo_heads"),
        (dict(head_dim=40), "head_dim"),
        (dict(target_density=0.0), "target_density"),
        (dict(target_density=1.5), "target_density"),
        (dict(dtype=torch.int32), "dtype"),
        (dict(batch=0), "batch"),
        (dict(device="nonsense"), "device"),
        (dict(config="default"), "config"),
    ],
)
def test_bad_arguments(kwargs, match):
    args = dict(seqlen=512, num_qo_heads=4, num_kv_heads=2, head_dim=32, device="cpu")
    args.update(kwargs)
    seqlen = args.pop("seqlen")
    with pytest.raises(ValueError, match=match):
        structured_inputs(seqlen, **args)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error message")
def test_cuda_unavailable_is_a_clear_error():
    with pytest.raises(ValueError, match="device"):
        structured_qkv(256, device="cuda")


@pytest.mark.parametrize(
    "seqlen, target, heads",
    [
        (2048, 0.8, SMALL),
        (4096, 0.5, SMALL),
        (4096, None, SMALL),  # the paper's 76%
        (3000, 0.7, dict(num_qo_heads=8, num_kv_heads=8, head_dim=32, device="cpu")),  # MHA, odd length
    ],
)
def test_calibration_matches_reference_index(seqlen, target, heads):
    x = structured_inputs(seqlen, target_density=target, **heads)
    index, plan = _reference_index(x)
    measured = reference.density(index, plan)
    # the prediction is exact when g divides 128 ...
    assert measured == pytest.approx(x.predicted_density, abs=1e-9)
    # ... and the knob lands within the brief's tolerance of the target
    want = x.target_density
    assert abs(measured - want) <= max(0.3 * want, 0.03)


def test_density_decreases_with_length_at_default():
    densities = []
    for seqlen in (2048, 4096, 8192):
        index, plan = _reference_index(structured_inputs(seqlen, **SMALL))
        densities.append(reference.density(index, plan))
    assert densities[0] > densities[1] > densities[2]
    assert densities[1] == pytest.approx(paper_density(4096), rel=0.3)
    assert densities[2] == pytest.approx(paper_density(8192), rel=0.3)


def test_selection_is_robust_to_alpha():
    """Salient blocks sit >= 1.5 nats over the threshold, the background >= 3.7 under it: the
    selected set (hence the density) is the same for alpha in [0.03, 0.3]."""
    x = structured_inputs(2048, target_density=0.75, **SMALL)
    dens = []
    for alpha in (0.03, 0.1, 0.3):
        index, plan = _reference_index(x, SparseConfig(alpha=alpha))
        dens.append(reference.density(index, plan))
    assert dens[0] == dens[1] == dens[2]


def test_index_density_matches_reference():
    batch = make_batch([300, 0, 517, 1], [0, 64, 200, 700], num_qo_heads=6, num_kv_heads=2,
                       head_dim=32, page_size=48, seed=1, needles=2, block_size=128)
    cfg = SparseConfig(alpha=0.2, sink_tokens=128, window_tokens=256)
    from kernels import ops

    plan = ops.plan_prefill(*batch.args(), cfg)
    index = reference.build_index(batch.q, batch.k_pages, batch.v_pages, plan)
    assert index_density(index, plan) == pytest.approx(reference.density(index, plan), abs=1e-12)


@pytest.fixture(scope="module")
def report_and_inputs():
    x = structured_inputs(2048, target_density=0.7, num_qo_heads=4, num_kv_heads=2, head_dim=64,
                          dtype=torch.float32, device="cpu")
    return fidelity_report(x.q, x.k, x.v, SparseConfig(), backend="reference",
                           needle_blocks=x.needle_blocks), x


def test_fidelity_report_fields(report_and_inputs):
    r, x = report_and_inputs
    assert r["density"] == pytest.approx(x.predicted_density, abs=1e-9)
    assert 0.0 <= r["retained_mass_min"] <= r["retained_mass"] <= 1.0
    assert r["retained_mass"] > 0.95
    assert r["needle_recall"] == 1.0 and r["needle_pairs"] > 0
    assert r["rel_l2"] == r["rel_l2_corrected"] and r["max_abs"] == r["max_abs_corrected"]
    assert 0.0 < r["rel_l2_corrected"] < 0.05
    assert r["rel_l2_dtype_floor"] == 0.0  # fp32 inputs: the exact output is representable
    assert r["backend"] == "reference" and r["alpha"] == 0.1


def test_mean_correction_is_closer_to_dense(report_and_inputs):
    r, _ = report_and_inputs
    assert r["rel_l2_corrected"] < 0.7 * r["rel_l2_uncorrected"]
    assert r["max_abs_corrected"] < r["max_abs_uncorrected"]


def test_alpha_zero_is_dense():
    x = structured_inputs(768, num_qo_heads=4, num_kv_heads=2, head_dim=32, dtype=torch.float32,
                          device="cpu")
    r = fidelity_report(x.q, x.k, x.v, SparseConfig(alpha=0.0), backend="reference")
    assert r["density"] == 1.0
    assert r["retained_mass_min"] == pytest.approx(1.0, abs=1e-5)
    assert r["rel_l2"] < 1e-5 and r["needle_recall"] is None


def test_needle_recall_sees_a_missed_block():
    x = structured_inputs(4096, target_density=0.45, **SMALL)
    index, plan = _reference_index(x)
    assert needle_recall(index, plan, x.needle_blocks)[0] == 1.0
    # a background block of head 0 (no slash there), queried from the last query block
    bs = plan.config.block_size
    taken = set(x.stripe_blocks[0]) | {int(r[2]) // bs for r in x.needle_blocks if r[1] == 0}
    free = next(j for j in range(2, 20) if j not in taken)
    bogus = torch.tensor([[0, 0, free * bs, (free + 1) * bs, 4096 - bs, 4096]])
    recall, pairs = needle_recall(index, plan, bogus)
    assert pairs == 4 and recall == 0.0  # g = 4: four query tiles per 128 positions
    with pytest.raises(ValueError, match="needle_blocks"):
        needle_recall(index, plan, torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="needle_blocks"):
        needle_recall(index, plan, torch.tensor([[0, 5, 0, 128, 1024, 2048]]))
