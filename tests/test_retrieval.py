"""The hand-built needle-retrieval model (evals/retrieval.py) on the CPU reference operator.

Small on purpose (<= 2K tokens, block 64, sink 64, window 128, so sparsity matters): dense
retrieval must be exact, the model deterministic, alpha=0 must be dense attention, and the
needle must be selected where the index rules force it. Sparse accuracies are printed (run
with ``-s``), not asserted, except for what the construction guarantees.
"""

import math

import pytest
import torch

from evals import density as fast_density
from evals.retrieval import (
    KEY_TOKENS, VALUE_TOKENS, NeedleRetrievalModel, hi_frequencies, locality, make_needle_batch,
    needle_selected, run_trials,
)
from kernels import reference
from kernels.config import SparseConfig

SMALL = dict(block_size=64, sink_tokens=64, window_tokens=128)
DENSE = SparseConfig(alpha=0.0, **SMALL)
SPARSE = SparseConfig(alpha=0.1, **SMALL)
SPARSE_NOCORR = SparseConfig(alpha=0.1, mean_correction=False, **SMALL)


@pytest.fixture(scope="module")
def model():
    return NeedleRetrievalModel()


def test_previous_token_logit_is_sharp_up_to_128k():
    w = hi_frequencies()
    d = torch.arange(1, 131073, dtype=torch.float64)
    s = torch.cos(d[:, None] * w[None]).sum(1)  # s[i] = logit / prev_logit at distance d from p-1
    assert s[0] <= 0.0  # j = p (distance 1 from the target p - 1)
    assert s[1:].max() <= 16.5  # every other visible key; the target scores 32
    assert math.isclose(float(locality(torch.tensor(0.0))), 1.0)


def test_batch_layout():
    b = make_needle_batch(300, 3, seed=4, needle_repeats=2)
    ids = b.ids
    assert (ids[:, 0] == 0).all()
    keys = ids[:, -1]
    assert all(int(k) in KEY_TOKENS and int(v) in VALUE_TOKENS for k, v in zip(keys, b.answers))
    for r in range(3):
        assert (ids[r, b.value_positions[r]] == b.answers[r]).all()
        assert (ids[r, b.value_positions[r] - 1] == keys[r]).all()
        assert int((ids[r] == keys[r]).sum()) == 3  # two needle copies + the final query


def test_dense_retrieval_is_exact(model):
    for length, trials in ((1024, 3), (2048, 1)):
        batch = make_needle_batch(length, trials, seed=length)
        out = model(batch.ids, DENSE)
        assert torch.equal(out.predictions, batch.answers), (length, out.predictions, batch.answers)
        for trace in out.traces:
            assert fast_density.density(trace.index, trace.plan) == 1.0
        # the answer carries essentially all the attention mass of the induction head
        assert (out.logits.gather(1, batch.answers[:, None]) > 0.99).all()


def test_deterministic_and_alpha0_is_dense(model):
    batch = make_needle_batch(512, 2, seed=7)
    a = model(batch.ids, DENSE)
    b = model(batch.ids, DENSE)
    assert torch.equal(a.logits, b.logits)
    # alpha = 0 selects everything, so there is nothing to correct
    c = model(batch.ids, SparseConfig(alpha=0.0, mean_correction=False, **SMALL))
    assert torch.equal(a.logits, c.logits)
    # and it matches an independent dense attention stage
    d = model(batch.ids, DENSE, backend="torch-dense")
    torch.testing.assert_close(a.logits, d.logits, atol=1e-5, rtol=1e-5)


def test_forced_needle_is_selected_and_retrieved(model):
    length = 1024
    # depth 0: needle inside the sink; depth 1: needle right before the final token (window)
    batch = make_needle_batch(length, 2, seed=11, depths=torch.tensor([0.0, 1.0]))
    for cfg in (SPARSE, SPARSE_NOCORR):
        out = model(batch.ids, cfg)
        assert needle_selected(out.traces[1], batch.value_positions).all()
        assert torch.equal(out.predictions, batch.answers)
        assert out.traces[1].plan.config.alpha == 0.1


def test_sparse_accuracy_report(model):
    """Prints dense/sparse/no-correction accuracy; asserts what the construction guarantees."""
    variants = {"dense": DENSE, "sparse": SPARSE, "sparse_nocorr": SPARSE_NOCORR}
    rows = []
    for repeats in (1, 16):
        res = run_trials(model, 1024, 4, variants, seed=3, needle_repeats=repeats, batch_size=4)
        by = {r.variant: r for r in res}
        rows += [(repeats, r.variant, r.accuracy, r.needle_selected, r.density_layer2) for r in res]
        assert by["dense"].accuracy == 1.0
        assert by["dense"].density_layer2 == 1.0
        assert 0.0 < by["sparse"].density_layer2 < 1.0
        # both sparse variants share the index; correction cannot un-select a needle
        assert by["sparse"].needle_selected == by["sparse_nocorr"].needle_selected
        if repeats == 1:
            # a single matching key is all-or-nothing: right iff its tile was selected
            assert by["sparse"].correct == by["sparse"].needle_selected
    for row in rows:
        print("needle_repeats=%d %-13s acc=%.2f selected=%d density(L2)=%.3f" % row)


def test_fast_density_matches_reference(model):
    batch = make_needle_batch(1024, 2, seed=5)
    out = model(batch.ids, SPARSE)
    for trace in out.traces:
        want = reference.density(trace.index, trace.plan)
        got, per_head = fast_density.density(trace.index, trace.plan, per_kv_head=True)
        assert math.isclose(got, want, rel_tol=1e-12)
        assert math.isclose(sum(per_head) / len(per_head), want, rel_tol=1e-12)
