"""The fidelity safeguards of the paper's released code (docs/SEMANTICS.md "Safeguards"):
dense last query tiles, the first-key energy rule, dense layers and per-layer alpha.

The expected values come from independent brute force (float64 loops over rows and blocks,
exact dense attention), never from the code under test; the Triton index (interpreter on
CPU) must agree with the reference on each option."""

from __future__ import annotations

import math
import os

import pytest
import torch

from kernels import reference
from kernels.config import KV_TILE, Q_TILE, SparseConfig
from kernels.ops import plan_prefill
from tests.helpers import spread_inputs

TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _batch(seqlens_q, prefixes, *, g=3, hkv=2, d=64, page_size=16, dtype=torch.float32, seed=0,
           config=None, prompt_lens=None, spread=3.0):
    """``tests.helpers.spread_inputs`` (GQA 3, as SmolLM2) on the test device, and its plan."""
    cfg = config or SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=128)
    inputs = tuple(x.to(DEVICE) for x in spread_inputs(
        seqlens_q, prefixes, g=g, hkv=hkv, d=d, page_size=page_size, dtype=dtype, seed=seed, spread=spread,
        block_size=cfg.block_size))
    q, k_pages, v_pages, table, cu, skv = inputs
    return inputs, plan_prefill(q, k_pages, v_pages, table, cu, skv, cfg, prompt_lens)


def _segments(index):
    offsets = index.seg_offsets.tolist()
    tiles = index.kv_tiles.cpu().tolist()
    return [tiles[offsets[s]: offsets[s + 1]] for s in range(len(offsets) - 1)]


def _replan(inputs, plan, config, prompt_lens=None):
    q, k, v, table, cu, skv = inputs
    return plan_prefill(q, k, v, table, cu, skv, config, prompt_lens)


# --------------------------------------------------------------------------- config
@pytest.mark.parametrize("field,value,match", [
    ("last_dense_tiles", -1, "last_dense_tiles"),
    ("last_dense_tiles", 1.5, "last_dense_tiles"),
    ("last_dense_tiles", True, "last_dense_tiles"),
    ("energy_rule", "max", "energy_rule"),
    ("energy_rule", None, "energy_rule"),
    ("dense_layers", -2, "dense_layers"),
    ("layer_alpha", "0.1", "layer_alpha"),
    ("layer_alpha", (0.1, 1.5), r"layer_alpha\[1\]"),
    ("layer_alpha", (0.1, True), r"layer_alpha\[1\]"),
])
def test_bad_option_names_it(field, value, match):
    with pytest.raises(ValueError, match=match):
        SparseConfig(**{field: value})


def test_alpha_of_layer_and_for_layer():
    cfg = SparseConfig(alpha=0.2, dense_layers=2, layer_alpha=[0.0, 0.5, 0.3, 0.05])
    assert cfg.layer_alpha == (0.0, 0.5, 0.3, 0.05)  # a list becomes a (hashable) tuple
    assert [cfg.alpha_of_layer(i) for i in range(6)] == [0.0, 0.0, 0.3, 0.05, 0.2, 0.2]
    layer5 = cfg.for_layer(5)
    assert layer5.alpha == 0.2 and layer5.dense_layers == 0 and layer5.layer_alpha is None
    assert cfg.for_layer(4) == layer5  # same threshold: one config, so one plan
    plain = SparseConfig(alpha=0.1)
    assert plain.for_layer(7) is plain


def test_bad_prompt_lens():
    with pytest.raises(ValueError, match=r"prompt_lens: expected 2 entries"):
        _batch([70, 40], [0, 10], prompt_lens=[70])
    with pytest.raises(ValueError, match=r"prompt_lens\[1\]"):
        _batch([70, 40], [0, 10], prompt_lens=[70, 49])
    with pytest.raises(ValueError, match="prompt_lens"):
        _batch([70], [0], prompt_lens=70)


# --------------------------------------------------------------------------- dense tiles
def _dense_rows(plan, b, n_tiles, prompt_len):
    """Independent: the packed rows (of this batch) of the prompt's last n tiles, counted over
    the whole prompt's rows from its first token."""
    g = plan.group_size
    total = g * prompt_len
    tiles = -(-total // Q_TILE)
    first_abs = Q_TILE * max(tiles - n_tiles, 0)
    offset = g * plan.prefix(b)
    return {r for r in range(g * plan.seqlens_q[b]) if r + offset >= first_abs}


@pytest.mark.parametrize("seqlens_q,prefixes,prompt_lens,n", [
    ([300, 130, 5], [0, 70, 400], None, 2),  # whole prompts, a cached prefix, a short one
    ([300, 130], [0, 70], [700, 200], 2),  # chunks that do not end their prompts
    ([257], [512], [900], 8),  # the last chunk's tiles reach back into this one
    ([64], [0], None, 5),  # more dense tiles than the prompt has
])
def test_dense_tile_rows_are_the_prompts_last_tiles(seqlens_q, prefixes, prompt_lens, n):
    cfg = SparseConfig(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=128, last_dense_tiles=n)
    _, plan = _batch(seqlens_q, prefixes, config=cfg, prompt_lens=prompt_lens)
    lens = prompt_lens or [a + b for a, b in zip(seqlens_q, prefixes)]
    for b in range(plan.batch_size):
        want = _dense_rows(plan, b, n, lens[b])
        for tile in range(plan.qtiles[b]):
            r0, rows, _, _ = plan.tile_rows(b, tile)
            assert plan.dense_tile(b, tile) == any(r in want for r in range(r0, r0 + rows)), (b, tile)


def test_whole_prompt_dense_tiles_are_exactly_the_last_n():
    cfg = SparseConfig(alpha=0.1, block_size=64, last_dense_tiles=2)
    _, plan = _batch([301], [0], config=cfg)  # g=3: 903 rows, 8 tiles, the last one short
    assert [plan.dense_tile(0, t) for t in range(plan.qtiles[0])] == [False] * 6 + [True] * 2


def _brute_force_dense(inputs, plan):
    """Exact causal attention in float64 from the pages, [Tq, Hq, d]."""
    q, k_pages, v_pages, table, cu, skv = inputs
    g = plan.group_size
    scale = 1 / math.sqrt(q.shape[-1])
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(plan.batch_size):
        lkv, lq, p0 = plan.seqlens_kv[b], plan.seqlens_q[b], plan.cu_seqlens_q_host[b]
        idx = torch.arange(lkv)
        pages = table[b].long().cpu()[idx // k_pages.shape[1]]
        k = k_pages.cpu()[pages, idx % k_pages.shape[1]].double()  # [lkv, Hkv, d]
        v = v_pages.cpu()[pages, idx % k_pages.shape[1]].double()
        qq = q[p0: p0 + lq].cpu().double()
        for h in range(q.shape[1]):
            s = scale * qq[:, h] @ k[:, h // g].T
            pos = torch.arange(lq)[:, None] + plan.prefix(b)
            s = s.masked_fill(idx[None, :] > pos, float("-inf"))
            out[p0: p0 + lq, h] = torch.softmax(s, -1) @ v[:, h // g]
    return out


def _cutlass_ready() -> bool:
    if not torch.cuda.is_available():
        return False
    from kernels.ops import cutlass_available

    return bool(cutlass_available(torch.device("cuda")))


BACKENDS = [
    pytest.param("reference", id="reference"),
    pytest.param("triton", id="triton", marks=pytest.mark.skipif(not TRITON, reason="Triton needs CUDA or the interpreter")),
    pytest.param("cutlass", id="cutlass", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not _cutlass_ready(), reason="needs a CUDA GPU and the CUTLASS library")]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("prompt_lens", [None, [520, 360]])
def test_dense_tile_rows_equal_dense_attention(prompt_lens, backend):
    """Every attention backend runs the dense tiles exactly dense: the index lists every block
    for them (the CUTLASS kernel takes the Triton index as it is)."""
    from kernels import ops

    seqlens_q, prefixes = [400, 200], [0, 150]
    cfg = SparseConfig(alpha=0.5, block_size=64, sink_tokens=0, window_tokens=64, last_dense_tiles=3)
    dtype = torch.float32 if backend != "cutlass" else torch.bfloat16
    inputs, plan = _batch(seqlens_q, prefixes, config=cfg, prompt_lens=prompt_lens, seed=5, dtype=dtype)
    index = ops.build_index_planned(inputs[0], inputs[1], inputs[2], plan, backend=backend)
    out, _ = ops.attention_planned(inputs[0], inputs[1], inputs[2], plan, index, backend=backend)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    want, out = _brute_force_dense(inputs, plan), out.cpu()  # compared on the host (CUTLASS: out on CUDA)
    g = plan.group_size
    lens = prompt_lens or [a + b for a, b in zip(seqlens_q, prefixes)]
    dense_rows = sparse_rows = 0
    for b in range(plan.batch_size):
        rows = _dense_rows(plan, b, 3, lens[b])
        p0 = plan.cu_seqlens_q_host[b]
        for r in range(g * plan.seqlens_q[b]):
            p, t = divmod(r, g)
            for hkv in range(plan.num_kv_heads):
                got, exact = out[p0 + p, hkv * g + t].double(), want[p0 + p, hkv * g + t]
                err = float((got - exact).abs().max())
                if r in rows:
                    dense_rows += 1
                    assert err < tol, f"sequence {b}, row {r}: a dense-tile row is off by {err}"
                else:
                    sparse_rows += err > 10 * tol
    # non-vacuous: the chunked case has no dense rows in sequence 1 only if its prompt goes on
    assert dense_rows > 0
    assert sparse_rows > 0, "alpha 0.5 pruned nothing: the test would not see a wrong dense tile"


# --------------------------------------------------------------------------- energy rule
def _brute_force_energies(inputs, plan, first_key):
    """Per segment, E_J (float64) from scratch: the rounded K means, a loop over rows."""
    q, k_pages, v_pages = inputs[:3]
    cfg = plan.config
    bs, g = cfg.block_size, plan.group_size
    scale = 1 / math.sqrt(q.shape[-1])
    means = reference.block_means(k_pages, v_pages, plan).kbar.to(q.dtype).double().cpu()
    out = {}
    for h in range(plan.num_kv_heads):
        for b in range(plan.batch_size):
            p0, prefix = plan.cu_seqlens_q_host[b], plan.prefix(b)
            for tile in range(plan.qtiles[b]):
                r0 = tile * Q_TILE
                r1 = min(r0 + Q_TILE, g * plan.seqlens_q[b])
                hi = (r1 - 1) // g + prefix
                nvis = hi // bs + 1
                scores = torch.full((r1 - r0, nvis), float("-inf"), dtype=torch.float64)
                for i, r in enumerate(range(r0, r1)):
                    p, t = divmod(r, g)
                    qi = q[p0 + p, h * g + t].cpu().double()
                    for j in range(nvis):
                        if first_key and (p + prefix < j * bs or (j + 1) * bs - 1 > hi):
                            continue
                        scores[i, j] = scale * float(qi @ means[plan.cu_blocks_host[b] + j, h])
                top = scores.max()
                # nothing scored (one block, not seen whole): every energy is 0
                e = torch.exp(scores - top).sum(0) if top > float("-inf") else torch.zeros(nvis, dtype=torch.float64)
                out[h * plan.total_tiles + plan.cu_qtiles_host[b] + tile] = e
    return out


@pytest.mark.parametrize("rule", ["first_key", "visible"])
def test_reference_energies_follow_the_rule(rule):
    cfg = SparseConfig(alpha=0.1, block_size=64, energy_rule=rule)
    inputs, plan = _batch([150, 90], [0, 100], hkv=1, seed=3, config=cfg)
    got = reference.block_energies(inputs[0], reference.block_means(inputs[1], inputs[2], plan), plan)
    want = _brute_force_energies(inputs, plan, rule == "first_key")
    for seg, e in want.items():
        torch.testing.assert_close(got[seg].cpu(), e, rtol=1e-9, atol=1e-12)


def test_first_key_differs_from_visible_and_never_scores_the_diagonal():
    base = SparseConfig(alpha=0.3, block_size=64, sink_tokens=0, window_tokens=1)
    inputs, plan = _batch([330], [37], seed=9, config=base)
    fk_plan = _replan(inputs, plan, SparseConfig(alpha=0.3, block_size=64, sink_tokens=0, window_tokens=1,
                                                 energy_rule="first_key"))
    means = reference.block_means(inputs[1], inputs[2], plan)
    fk = reference.block_energies(inputs[0], means, fk_plan)
    for seg, e in enumerate(fk):
        b, tile = 0, seg % plan.total_tiles
        _, _, _, hi = plan.tile_rows(b, tile)
        hi += plan.prefix(b)
        scored = (hi + 1) // 64
        assert torch.all(e[scored:] == 0), "a block the last row does not see whole was scored"
    a = _segments(reference.build_index(inputs[0], inputs[1], inputs[2], plan))
    c = _segments(reference.build_index(inputs[0], inputs[1], inputs[2], fk_plan))
    assert a != c, "the two rules selected the same blocks: the case does not tell them apart"


# --------------------------------------------------------------------------- Triton agrees
CASES = [
    # seqlens_q, prefixes, prompt_lens, config
    ([333, 129, 1], [0, 190, 64], None, dict(energy_rule="first_key")),
    ([333, 129, 1], [0, 190, 64], None, dict(last_dense_tiles=2)),
    ([333, 129], [0, 190], [900, 400], dict(last_dense_tiles=3, energy_rule="first_key")),
    ([400, 77], [33, 0], [433, 77], dict(last_dense_tiles=8, energy_rule="first_key", alpha=0.3)),
]


@pytest.mark.skipif(not TRITON, reason="Triton needs a CUDA GPU or TRITON_INTERPRET=1")
@pytest.mark.parametrize("seqlens_q,prefixes,prompt_lens,opts", CASES)
def test_triton_index_matches_reference(seqlens_q, prefixes, prompt_lens, opts):
    from kernels import triton_index

    cfg = SparseConfig(**{**dict(alpha=0.1, block_size=64, sink_tokens=64, window_tokens=128), **opts})
    inputs, plan = _batch(seqlens_q, prefixes, config=cfg, prompt_lens=prompt_lens, dtype=torch.bfloat16,
                          seed=sum(seqlens_q))
    got = triton_index.build_index(inputs[0], inputs[1], inputs[2], plan)
    want = reference.build_index(inputs[0], inputs[1], inputs[2], plan)
    ratios = None
    for seg, (a, b) in enumerate(zip(_segments(got), _segments(want))):
        if a == b:
            continue
        ratios = ratios or reference.block_energy_ratios(inputs[0], want.means, plan)
        for blk in {t // cfg.tiles_per_block for t in set(a) ^ set(b)}:
            r = float(ratios[seg][blk])
            assert abs(r - cfg.alpha) <= 1e-3 * cfg.alpha, f"segment {seg} block {blk}: {a} vs {b}"
    # dense tiles list every visible 64-key tile: check against the geometry directly
    for h in range(plan.num_kv_heads):
        for b in range(plan.batch_size):
            for tile in range(plan.qtiles[b]):
                if not plan.dense_tile(b, tile):
                    continue
                _, _, _, pmax = plan.tile_rows(b, tile)
                last = min(plan.seqlens_kv[b] - 1, pmax + plan.prefix(b))
                seg = h * plan.total_tiles + plan.cu_qtiles_host[b] + tile
                assert _segments(got)[seg] == list(range(last // KV_TILE + 1))


# --------------------------------------------------------------------------- model and engine
def _record_indices(monkeypatch):
    """Every (plan, index) the model's attention builds, in call order."""
    from model_executor import attention

    seen = []
    build = attention.ops.build_index_planned

    def recording(q, k_pages, v_pages, plan, **kw):
        index = build(q, k_pages, v_pages, plan, **kw)
        seen.append((plan, index))
        return index

    monkeypatch.setattr(attention.ops, "build_index_planned", recording)
    return seen


def _check_dense_tiles(plan, index, prompt_len, n_tiles, absolute_start):
    """Independent of the plan's own rule: a tile whose rows reach the prompt's last
    ``n_tiles`` tiles (counted over the whole prompt) lists every visible 64-key tile, and
    the count of such tiles is returned."""
    g = plan.group_size
    first_abs = Q_TILE * max(-(-g * prompt_len // Q_TILE) - n_tiles, 0)
    segs = _segments(index)
    dense = 0
    for tile in range(plan.qtiles[0]):
        r0, rows, _, pmax = plan.tile_rows(0, tile)
        if r0 + rows - 1 + g * absolute_start < first_abs:
            continue
        dense += 1
        last = min(plan.seqlens_kv[0] - 1, pmax + plan.prefix(0))
        for h in range(plan.num_kv_heads):
            assert segs[h * plan.total_tiles + tile] == list(range(last // KV_TILE + 1)), (tile, h)
    return dense


def test_chunked_prefill_keeps_the_prompts_last_tiles_dense(tiny, monkeypatch):
    from model_executor import ModelRunner
    from model_executor.loading import make_pool
    from model_executor.sampling import SamplingParams
    from prefill_worker.engine import PrefillEngine, PrefillRequest

    cfg = SparseConfig(alpha=0.9, block_size=64, sink_tokens=64, window_tokens=64, last_dense_tiles=2)
    pool = make_pool(tiny, num_pages=40, page_size=16)
    engine = PrefillEngine(ModelRunner(tiny.model, pool, cfg, dense_below=0), chunk_size=200)
    seen = _record_indices(monkeypatch)
    prompt = torch.randint(0, 256, (610,), generator=torch.Generator().manual_seed(7)).tolist()
    engine.prefill([PrefillRequest("p", prompt, SamplingParams(temperature=0.0, max_new_tokens=1))])
    layers = tiny.num_layers
    assert len(seen) == 4 * layers  # chunks of 200, 200, 200, 10 tokens
    dense_per_chunk = []
    for c in range(4):
        plan, index = seen[c * layers]
        start = plan.prefix(0)
        assert start == 200 * c
        dense_per_chunk.append(_check_dense_tiles(plan, index, 610, 2, start))
        # the plan's own view agrees with the independent count
        assert sum(plan.dense_tile(0, t) for t in range(plan.qtiles[0])) == dense_per_chunk[-1]
    # g = 4: the last 2 tiles are the last 64 positions (546..609): chunk 2 holds 546..599
    assert dense_per_chunk == [0, 0, 2, 1]


def test_a_prefix_cache_hit_keeps_the_same_dense_rows(tiny, monkeypatch):
    from model_executor import ModelRunner
    from model_executor.loading import make_pool
    from model_executor.sampling import SamplingParams
    from prefill_worker.engine import PrefillEngine, PrefillRequest

    cfg = SparseConfig(alpha=0.9, block_size=64, sink_tokens=64, window_tokens=64, last_dense_tiles=3)
    pool = make_pool(tiny, num_pages=120, page_size=16)
    engine = PrefillEngine(ModelRunner(tiny.model, pool, cfg, dense_below=0), prefix_cache=True)
    gen = torch.Generator().manual_seed(8)
    doc = torch.randint(0, 256, (700,), generator=gen).tolist()
    second = doc + torch.randint(0, 256, (45,), generator=gen).tolist()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
    engine.prefill([PrefillRequest("a", doc + [1, 2, 3], greedy)])
    seen = _record_indices(monkeypatch)
    hit = engine.prefill([PrefillRequest("b", second, greedy)])[0]
    assert hit.cached_tokens > 0
    plan, index = seen[0]
    assert plan.prefix(0) == hit.cached_tokens
    assert _check_dense_tiles(plan, index, len(second), 3, hit.cached_tokens) == 3


def test_a_requests_own_options_change_its_selection(tiny):
    from model_executor import ModelRunner
    from model_executor.loading import make_pool
    from model_executor.sampling import SamplingParams
    from prefill_worker.engine import PrefillEngine, PrefillRequest

    cfg = SparseConfig(alpha=0.9, block_size=64, sink_tokens=64, window_tokens=64, last_dense_tiles=0)
    engine = PrefillEngine(ModelRunner(tiny.model, make_pool(tiny, num_pages=120, page_size=16), cfg, dense_below=0))
    prompt = torch.randint(0, 256, (600,), generator=torch.Generator().manual_seed(9)).tolist()
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
    plain, guarded, dense = engine.prefill([
        PrefillRequest("plain", prompt, greedy),
        PrefillRequest("guarded", prompt, greedy, sparse_options=(("last_dense_tiles", 8),)),
        PrefillRequest("dense", prompt, greedy, sparse_options=(("dense_layers", 4),)),
    ])
    assert plain.block_density < guarded.block_density < 1.0
    assert dense.block_density in (None, 1.0)  # every layer dense (the reference builds no index)
    with pytest.raises(ValueError, match=r"sparse_options.energy_rule"):
        engine.prefill([PrefillRequest("bad", prompt, greedy, sparse_options=(("energy_rule", "max"),))])
    with pytest.raises(ValueError, match=r"sparse_options: alpha goes in sparse_alpha"):
        engine.prefill([PrefillRequest("bad2", prompt, greedy, sparse_options=(("alpha", 0.5),))])


def test_dense_layers_and_layer_alpha_in_the_runner(tiny, monkeypatch):
    from model_executor import ModelRunner
    from model_executor.loading import make_pool
    from model_executor.runner import PrefillItem

    cfg = SparseConfig(alpha=0.9, block_size=64, sink_tokens=64, window_tokens=64, dense_layers=1,
                       layer_alpha=(0.5, 0.5, 0.0, 0.3))
    runner = ModelRunner(tiny.model, make_pool(tiny, num_pages=60, page_size=16), cfg, dense_below=0,
                         backend="reference")
    seen = _record_indices(monkeypatch)
    dense_calls = []
    dense_attention = reference.dense_attention
    monkeypatch.setattr(reference, "dense_attention", lambda *a, **kw: dense_calls.append(1) or dense_attention(*a, **kw))
    ids = torch.randint(0, 256, (500,), generator=torch.Generator().manual_seed(10)).tolist()
    runner.pool.reserve("x", len(ids))
    runner.prefill([PrefillItem("x", ids)])
    # layer 0 dense (dense_layers), layer 2 dense (its alpha 0), layers 1 and 3 sparse at their own
    assert [p.config.alpha for p, _ in seen] == [0.5, 0.3]
    assert len(dense_calls) == 2
    with pytest.raises(ValueError, match="sparse_config.layer_alpha"):
        ModelRunner(tiny.model, make_pool(tiny, num_pages=4, page_size=16),
                    SparseConfig(layer_alpha=(0.1,) * 5), dense_below=0)
    runner.pool.reserve("y", 10)
    with pytest.raises(ValueError, match="prompt_len"):
        runner.prefill([PrefillItem("y", ids[:10], 0, 5)])
