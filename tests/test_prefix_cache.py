"""Prefix caching in the prefill engine (kv_cache/manager.py + prefill_worker/engine.py): a
prompt that starts like an earlier one reuses its pages and computes only the rest, with the
result of computing everything (dense attention: equal up to fp32 rounding), no page leaked or
shared wrongly, eviction under pressure, failures that cache nothing."""

from __future__ import annotations

import pytest
import torch

from kernels.config import SparseConfig
from kv_cache import PoolExhausted
from model_executor import ModelRunner
from model_executor.loading import make_pool
from model_executor.sampling import SamplingParams
from prefill_worker.engine import PrefillEngine, PrefillRequest

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=1)
PAGE = 16


def _engine(tiny, *, cache, num_pages=40, chunk_size=None, config=SparseConfig(alpha=0.0)):
    pool = make_pool(tiny, num_pages=num_pages, page_size=PAGE)
    runner = ModelRunner(tiny.model, pool, config, dense_below=0)
    return pool, PrefillEngine(runner, chunk_size=chunk_size, prefix_cache=cache)


def _tokens(n, seed):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _kv(pool, rid, n):
    """The request's K and V of tokens [0, n), every layer, gathered from its pages."""
    pages = torch.tensor(pool.pages(rid))
    k = pool.k[:, pages].reshape(pool.num_layers, -1, pool.num_kv_heads, pool.head_dim)[:, :n]
    v = pool.v[:, pages].reshape(pool.num_layers, -1, pool.num_kv_heads, pool.head_dim)[:, :n]
    return k, v


@pytest.mark.parametrize("chunk_size", [None, 20])
def test_a_shared_prefix_is_reused_and_gives_what_computing_it_gives(tiny, chunk_size):
    doc = _tokens(3 * PAGE + 5, seed=1)  # 3 full pages shared, 5 tokens more
    first, second = doc + _tokens(30, seed=2), doc + _tokens(11, seed=3)
    pool, engine = _engine(tiny, cache=True, chunk_size=chunk_size)
    a = engine.prefill([PrefillRequest("a", first, GREEDY)])[0]
    assert a.cached_tokens == 0 and pool.stats()["cached_pages"] == len(first) // PAGE
    b = engine.prefill([PrefillRequest("b", second, GREEDY)])[0]
    assert b.cached_tokens == 3 * PAGE and b.kv_len == len(second)
    assert list(b.pages[:3]) == list(a.pages[:3]) and not set(b.pages[3:]) & set(a.pages)
    # the same prompt without the cache: same first token, same K/V (fp32 rounding apart)
    ref_pool, ref = _engine(tiny, cache=False, chunk_size=chunk_size)
    r = ref.prefill([PrefillRequest("b", second, GREEDY)])[0]
    assert r.first_token == b.first_token and r.cached_tokens == 0
    for got, want in zip(_kv(pool, "b", len(second)), _kv(ref_pool, "b", len(second))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    # release in either order: no page is freed while another request holds it, none leaks
    engine.release("a")
    assert _kv(pool, "b", 3 * PAGE)[0].abs().sum() > 0 and pool.free_pages == pool.num_pages - len(b.pages)
    engine.release("b")
    assert pool.free_pages == pool.num_pages and pool.stats()["requests"] == 0


def test_the_same_prompt_again_still_computes_its_last_token(tiny):
    prompt = _tokens(4 * PAGE, seed=4)  # exactly 4 pages
    pool, engine = _engine(tiny, cache=True)
    a = engine.prefill([PrefillRequest("a", prompt, GREEDY)])[0]
    b = engine.prefill([PrefillRequest("b", prompt, GREEDY)])[0]
    assert b.cached_tokens == 3 * PAGE  # the last page is computed again: the first token needs it
    assert b.first_token == a.first_token and b.pages[:3] == a.pages[:3] and b.pages[3] != a.pages[3]
    engine.release("a")
    engine.release("b")
    c = engine.prefill([PrefillRequest("c", prompt[:PAGE], GREEDY)])[0]  # one page: nothing to reuse
    assert c.cached_tokens == 0


def test_prompts_in_one_batch_do_not_share_and_different_prompts_never_do(tiny):
    doc = _tokens(2 * PAGE, seed=5)
    pool, engine = _engine(tiny, cache=True)
    res = engine.prefill([PrefillRequest("a", doc + [1], GREEDY), PrefillRequest("b", doc + [2], GREEDY)])
    assert [r.cached_tokens for r in res] == [0, 0]  # neither was cached when the batch started
    other = engine.prefill([PrefillRequest("c", [doc[0] + 1] + doc[1:] + [3], GREEDY)])[0]
    assert other.cached_tokens == 0  # one token differs in the first page
    again = engine.prefill([PrefillRequest("d", doc + [4], GREEDY)])[0]
    assert again.cached_tokens == 2 * PAGE and again.pages[:2] == res[0].pages[:2]  # a's pages were cached first


def test_cached_pages_are_evicted_when_the_pool_needs_them(tiny):
    pool, engine = _engine(tiny, cache=True, num_pages=8)
    for i in range(6):  # 6 prompts of 3 pages each through an 8-page pool: every one fits
        r = engine.prefill([PrefillRequest(f"r{i}", _tokens(3 * PAGE, seed=10 + i), GREEDY)])[0]
        engine.release(r.request_id)
        assert pool.free_pages == 8
    assert pool.stats()["cached_pages"] <= 8
    # the newest prompt's pages are the last to go
    assert engine.prefill([PrefillRequest("x", _tokens(3 * PAGE, seed=15), GREEDY)])[0].cached_tokens == 2 * PAGE


def test_a_failed_prefill_caches_nothing_and_frees_everything(tiny, monkeypatch):
    pool, engine = _engine(tiny, cache=True)
    doc = _tokens(3 * PAGE, seed=20)
    engine.release(engine.prefill([PrefillRequest("a", doc + [5], GREEDY)])[0].request_id)
    cached = pool.stats()["cached_pages"]

    def boom(items):
        raise RuntimeError("device fault")

    monkeypatch.setattr(engine.runner, "prefill", boom)
    with pytest.raises(RuntimeError, match="device fault"):
        engine.prefill([PrefillRequest("b", doc + _tokens(40, seed=21), GREEDY)])
    assert pool.free_pages == pool.num_pages and pool.stats()["cached_pages"] == cached
    assert not pool.has("b")


def test_pool_exhaustion_with_a_cached_prefix_allocates_nothing(tiny):
    pool, engine = _engine(tiny, cache=True, num_pages=6)
    doc = _tokens(2 * PAGE, seed=30)
    a = engine.prefill([PrefillRequest("a", doc + [1], GREEDY)])[0]  # 3 pages, 2 cached, held
    before = pool.stats()
    with pytest.raises(PoolExhausted):  # 2 shared + 5 new > 3 free
        engine.prefill([PrefillRequest("b", doc + _tokens(70, seed=31), GREEDY)])
    assert pool.stats() == before and pool.pages("a") == list(a.pages)


def test_prefix_cache_argument_is_checked(tiny):
    pool = make_pool(tiny, num_pages=4, page_size=PAGE)
    runner = ModelRunner(tiny.model, pool, SparseConfig(alpha=0.0), dense_below=0)
    with pytest.raises(ValueError, match="prefix_cache: expected a bool"):
        PrefillEngine(runner, prefix_cache="yes")


def test_sparse_prefill_reuses_whole_query_tiles_and_computes_what_a_miss_computes(tiny):
    """alpha > 0: the reused prefix is a multiple of the 128-row query tile, so the new tokens'
    block selection is the whole prompt's: a hit gives the miss's K/V and first token."""
    # alpha 0.9: few blocks pass, so a shifted tile grid selects other blocks (reusing the 688
    # tokens of whole pages instead of 640 makes K/V differ by up to ~8: checked when written)
    sparse = SparseConfig(alpha=0.9, block_size=64, sink_tokens=64, window_tokens=64)
    doc = _tokens(700, seed=40)  # 43 full pages of 16; reusable: 640 tokens (5 tiles of 128)
    first, second = doc + _tokens(20, seed=41), doc + _tokens(45, seed=42)
    pool, engine = _engine(tiny, cache=True, config=sparse, num_pages=120)
    assert engine.reuse_granule == 128
    engine.prefill([PrefillRequest("a", first, GREEDY)])
    b = engine.prefill([PrefillRequest("b", second, GREEDY)])[0]
    assert b.cached_tokens == 640
    ref_pool, ref = _engine(tiny, cache=False, config=sparse, num_pages=120)
    r = ref.prefill([PrefillRequest("b", second, GREEDY)])[0]
    assert r.first_token == b.first_token
    for got, want in zip(_kv(pool, "b", len(second)), _kv(ref_pool, "b", len(second))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
