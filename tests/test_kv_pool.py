"""The paged KV pool: accounting, exhaustion, capacity, addressing round trips, FP8, threads."""

from __future__ import annotations

import pickle
import threading

import pytest
import torch

from kernels.paged import gather_kv
from kv_cache import KVPool, KVPoolConfig, PoolExhausted, fp8_scale_from_amax


def make_pool(num_pages=16, page_size=4, dtype=torch.float32, **kw) -> KVPool:
    cfg = dict(num_layers=2, num_kv_heads=2, head_dim=8, page_size=page_size, dtype=dtype, num_pages=num_pages)
    cfg.update(kw)
    return KVPool(KVPoolConfig(**cfg))


# ---------------------------------------------------------------- layout
def test_layout_and_page_bytes():
    pool = make_pool(dtype=torch.bfloat16)
    assert pool.k.shape == (2, 16, 4, 2, 8) and pool.v.shape == (2, 16, 4, 2, 8)
    assert pool.k.dtype == torch.bfloat16 and pool.k_scale is None and pool.v_scale is None
    assert pool.page_bytes == 2 * 2 * 4 * 2 * 8 * 2  # K+V x layers x tokens x heads x d x bytes
    assert pool.k[1].shape == (16, 4, 2, 8)  # layer view: the kernels' k_pages
    assert pool.stats() == {
        "num_pages": 16, "free_pages": 16, "used_pages": 0, "requests": 0, "cached_pages": 0,
        "evictable_pages": 0, "page_size": 4, "dtype": "bfloat16", "page_bytes": pool.page_bytes,
    }


def test_memory_budget_capacity():
    page_bytes = make_pool().page_bytes
    pool = make_pool(num_pages=None, memory_budget_bytes=10 * page_bytes + page_bytes - 1)
    assert pool.num_pages == 10 and pool.free_pages == 10 and pool.k.shape[1] == 10
    fp8 = make_pool(num_pages=None, memory_budget_bytes=10 * page_bytes, dtype=torch.float8_e4m3fn)
    assert fp8.page_bytes * 4 == page_bytes and fp8.num_pages == 40


# ---------------------------------------------------------------- accounting
def test_reserve_grow_release_accounting():
    pool = make_pool()
    assert pool.reserve("a", 5) == [0, 1]  # fresh pool hands out 0, 1, 2, ...
    assert pool.reserve("b", 4) == [2]
    assert pool.used_pages == 3 and pool.free_pages == 13
    assert pool.has("a") and not pool.has("zz")
    assert pool.reserve("a", 8) == [0, 1]  # fits: no new page
    assert pool.reserve("a", 9) == [0, 1, 3]  # grows in place, keeps its pages
    assert pool.pages("a") == [0, 1, 3] and pool.seq_len("a") == 0
    pool.set_seq_len("a", 9)
    assert pool.seq_len("a") == 9
    assert pool.reserve("a", 9) == [0, 1, 3]  # idempotent
    assert pool.stats()["requests"] == 2
    assert pool.release("a") == 3
    assert not pool.has("a") and pool.free_pages == 15
    assert pool.release("a") == 0 and pool.release("never") == 0
    # LIFO: the released request's first page comes back first
    assert pool.reserve("c", 12) == [0, 1, 3]
    assert pool.reserve("d", 0) == [] and pool.has("d")


def test_reserve_rejects_shrinking_below_seq_len():
    pool = make_pool()
    pool.reserve("a", 10)
    pool.set_seq_len("a", 7)
    with pytest.raises(ValueError, match="num_tokens"):
        pool.reserve("a", 6)
    with pytest.raises(ValueError, match="num_tokens"):
        pool.reserve("b", -1)
    with pytest.raises(ValueError, match="n"):
        pool.set_seq_len("a", 13)  # beyond the 3 pages held
    with pytest.raises(KeyError):
        pool.seq_len("missing")
    with pytest.raises(KeyError):
        pool.page_table(["a", "missing"])


def test_exhaustion_is_all_or_nothing():
    pool = make_pool(num_pages=4)
    pool.reserve("a", 8)  # 2 pages
    with pytest.raises(PoolExhausted) as info:
        pool.reserve("b", 13)  # needs 4
    assert info.value.requested == 4 and info.value.free == 2
    assert isinstance(info.value, RuntimeError)
    assert not pool.has("b") and pool.free_pages == 2
    with pytest.raises(PoolExhausted):
        pool.reserve("a", 8 + 4 * 3)  # growth needs 3 more
    assert pool.pages("a") == [0, 1] and pool.free_pages == 2
    with pytest.raises(PoolExhausted):
        pool.adopt("c", 9)
    assert not pool.has("c") and pool.free_pages == 2
    # typed fields survive pickling (Ray ships exceptions between processes)
    again = pickle.loads(pickle.dumps(info.value))
    assert (again.requested, again.free, again.request_id) == (4, 2, "b")
    pool.release("a")
    assert pool.reserve("b", 13) == [0, 1, 2, 3]


def test_adopt():
    pool = make_pool()
    pages = pool.adopt("x", 10)
    assert len(pages) == 3 and pool.seq_len("x") == 10 and pool.pages("x") == pages
    with pytest.raises(ValueError, match="request_id"):
        pool.adopt("x", 4)
    assert pool.adopt("empty", 0) == []


def test_rename_moves_pages_and_seq_len():
    pool = make_pool()
    pages = pool.adopt("x", 10)
    pool.reserve("y", 3)
    pool.rename("x", "x-moved")
    assert not pool.has("x") and pool.pages("x-moved") == pages and pool.seq_len("x-moved") == 10
    assert pool.free_pages == pool.num_pages - len(pages) - 1 and pool.stats()["requests"] == 2
    with pytest.raises(KeyError, match="request_id"):
        pool.rename("x", "z")
    with pytest.raises(ValueError, match="new_id"):
        pool.rename("x-moved", "y")
    assert pool.pages("x-moved") == pages and pool.pages("y") != pages  # a refused rename changes nothing
    assert pool.release("x-moved") == len(pages)


# ---------------------------------------------------------------- addressing and data
@pytest.mark.parametrize("page_size", [1, 3, 4])
def test_write_round_trip_against_gather_kv(page_size):
    gen = torch.Generator().manual_seed(0)
    pool = make_pool(num_pages=64, page_size=page_size)
    lengths = {"a": 11, "b": 1, "c": 7}
    for rid in ("a", "b", "c"):
        pool.reserve(rid, 2)  # interleaved growth scatters each request's pages
    keys = {r: torch.randn(n, 2, 8, generator=gen) for r, n in lengths.items()}
    vals = {r: torch.randn(n, 2, 8, generator=gen) for r, n in lengths.items()}
    # "prefill" the first part, then append the rest, as a model runner does
    first = {r: min(n, 5) for r, n in lengths.items()}
    for phase in ("prefill", "append"):
        ids = list(lengths)
        starts = [0 if phase == "prefill" else first[r] for r in ids]
        lens = [first[r] if phase == "prefill" else lengths[r] - first[r] for r in ids]
        for r, s, n in zip(ids, starts, lens):
            pool.reserve(r, s + n)
        slots = pool.slot_mapping(ids, starts, lens)
        assert slots.dtype == torch.int64 and slots.shape == (sum(lens),)
        for layer in range(2):
            k = torch.cat([keys[r][s : s + n] for r, s, n in zip(ids, starts, lens)]) + layer
            v = torch.cat([vals[r][s : s + n] for r, s, n in zip(ids, starts, lens)]) - layer
            pool.write(layer, slots, k, v)
        for r, s, n in zip(ids, starts, lens):
            pool.set_seq_len(r, s + n)
    table = pool.page_table(["c", "a", "b"])
    assert table.dtype == torch.int32
    assert table.shape == (3, max(len(pool.pages(r)) for r in lengths))
    for row, rid in enumerate(["c", "a", "b"]):
        n = pool.seq_len(rid)
        assert n == lengths[rid]
        assert table[row, : len(pool.pages(rid))].tolist() == pool.pages(rid)
        assert (table[row, len(pool.pages(rid)) :] == 0).all()
        for layer in range(2):
            assert torch.equal(gather_kv(pool.k[layer], table, row, n), keys[rid] + layer)
            assert torch.equal(gather_kv(pool.v[layer], table, row, n), vals[rid] - layer)


def test_slot_mapping_values_and_errors():
    pool = make_pool(page_size=4)
    pool.reserve("a", 4)
    pool.reserve("b", 4)
    pool.reserve("a", 8)  # a: pages [0, 2]
    assert pool.slot_mapping(["a"], [2], [4]).tolist() == [2, 3, 8, 9]
    assert pool.slot_mapping(["a", "b"], [7, 0], [1, 0]).tolist() == [11]
    assert pool.slot_mapping([], [], []).shape == (0,)
    assert pool.page_table([]).shape == (0, 1)
    with pytest.raises(ValueError, match="lengths"):
        pool.slot_mapping(["a"], [6], [3])  # past the reserved pages
    with pytest.raises(ValueError, match="starts"):
        pool.slot_mapping(["a"], [0, 1], [1])
    with pytest.raises(ValueError, match="starts"):
        pool.slot_mapping(["a"], [-1], [1])


def test_write_validation():
    pool = make_pool()
    pool.reserve("a", 3)
    slots = pool.slot_mapping(["a"], [0], [3])
    kv = torch.randn(3, 2, 8)
    with pytest.raises(ValueError, match="layer"):
        pool.write(2, slots, kv, kv)
    with pytest.raises(ValueError, match="slots"):
        pool.write(0, slots.float(), kv, kv)
    with pytest.raises(ValueError, match="k"):
        pool.write(0, slots, kv[:2], kv)
    with pytest.raises(ValueError, match="v"):
        pool.write(0, slots, kv, kv[..., :4])
    with pytest.raises(ValueError, match="k"):
        pool.write(0, slots, kv.int(), kv)


def test_fp8_round_trip():
    gen = torch.Generator().manual_seed(1)
    pool = make_pool(dtype=torch.float8_e4m3fn, page_size=4)
    assert pool.k.dtype == torch.float8_e4m3fn
    assert pool.k_scale.shape == (2, 2) and pool.k_scale.dtype == torch.float32
    k = torch.randn(10, 2, 8, generator=gen) * torch.tensor([1.0, 30.0])[None, :, None]
    v = torch.randn(10, 2, 8, generator=gen) * 0.01
    pool.calibrate_scales(1, k, v)
    assert torch.allclose(pool.k_scale[1], fp8_scale_from_amax(k))
    assert torch.equal(pool.k_scale[0], torch.ones(2))  # other layers untouched
    pool.reserve("a", 10)
    slots = pool.slot_mapping(["a"], [0], [10])
    pool.write(1, slots, k, v)
    table = pool.page_table(["a"])
    for pages, scale, x in ((pool.k, pool.k_scale, k), (pool.v, pool.v_scale, v)):
        stored = gather_kv(pages[1], table, 0, 10).float()
        back = stored * scale[1][None, :, None]
        # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus the subnormal floor
        err = (back - x).abs()
        bound = x.abs() * 2**-4 + scale[1][None, :, None] * 2**-9
        assert (err <= bound).all()
        assert stored.abs().max() <= 448
    # saturation instead of inf/nan for values past the calibrated range
    pool.write(1, slots[:1], k[:1] * 1000, v[:1])
    assert torch.isfinite(pool.k[1].float()).all()


def test_set_scales_validation():
    with pytest.raises(ValueError, match="k_scale"):
        make_pool().set_scales(0, 1.0, 1.0)  # not an FP8 pool
    pool = make_pool(dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="k_scale"):
        pool.set_scales(0, 0.0, 1.0)
    with pytest.raises(ValueError, match="v_scale"):
        pool.set_scales(0, 1.0, float("nan"))
    pool.set_scales(0, torch.tensor([0.5, 2.0]), 3.0)
    assert pool.k_scale[0].tolist() == [0.5, 2.0] and pool.v_scale[0].tolist() == [3.0, 3.0]


# ---------------------------------------------------------------- bad config
@pytest.mark.parametrize(
    "over,match",
    [
        (dict(num_layers=0), "num_layers"),
        (dict(num_layers=2.0), "num_layers"),
        (dict(num_kv_heads=-1), "num_kv_heads"),
        (dict(head_dim=0), "head_dim"),
        (dict(page_size=0), "page_size"),
        (dict(page_size=True), "page_size"),
        (dict(dtype=torch.int8), "dtype"),
        (dict(dtype=torch.float64), "dtype"),
        (dict(device="nonsense"), "device"),
        (dict(num_pages=None), "num_pages"),  # neither
        (dict(num_pages=4, memory_budget_bytes=1 << 20), "num_pages"),  # both
        (dict(num_pages=0), "num_pages"),
        (dict(num_pages=None, memory_budget_bytes=10), "memory_budget_bytes"),  # below one page
        (dict(num_pages=None, memory_budget_bytes=-5), "memory_budget_bytes"),
    ],
)
def test_bad_config(over, match):
    cfg = dict(num_layers=2, num_kv_heads=2, head_dim=8, num_pages=4)
    cfg.update(over)
    with pytest.raises(ValueError, match=match):
        KVPoolConfig(**cfg)


def test_pool_needs_config():
    with pytest.raises(ValueError, match="config"):
        KVPool(dict(num_layers=1))


# ---------------------------------------------------------------- threads
def test_concurrent_reserve_release_never_double_allocates():
    pool = make_pool(num_pages=40, page_size=2)
    errors: list[BaseException] = []
    owned: dict[str, list[int]] = {}
    owned_lock = threading.Lock()
    start = threading.Barrier(8)

    def worker(w: int) -> None:
        gen = torch.Generator().manual_seed(w)
        try:
            start.wait()
            for i in range(300):
                rid = f"w{w}-{i % 3}"
                if torch.rand(1, generator=gen).item() < 0.35:
                    with owned_lock:
                        owned.pop(rid, None)
                    pool.release(rid)
                    continue
                tokens = int(torch.randint(1, 13, (1,), generator=gen))
                try:
                    cur = pool.seq_len(rid) if pool.has(rid) else 0
                    pages = pool.reserve(rid, max(cur, tokens))
                except PoolExhausted:
                    continue
                with owned_lock:
                    owned[rid] = pages
                    seen: dict[int, str] = {}
                    for other, plist in owned.items():
                        for p in plist:
                            if p in seen and seen[p] != other:
                                raise AssertionError(f"page {p} held by {seen[p]} and {other}")
                            seen[p] = other
        except BaseException as exc:  # surface thread failures in the test
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    held = [p for r in list(owned) if pool.has(r) for p in pool.pages(r)]
    assert len(held) == len(set(held))
    assert pool.used_pages == len(held)
    assert pool.used_pages + pool.free_pages == pool.num_pages
    for rid in list(owned):
        pool.release(rid)
    assert pool.free_pages == pool.num_pages
    assert sorted(pool.manager.blocks.free) == list(range(pool.num_pages))


def test_fp8_v_is_token_major():
    """FP8 pools store V as [layers, pages, heads, head_dim, page_size] (the K-major operand of
    fp8 wgmma; kernels/cutlass_attention.py): ``v`` is that memory seen slot-major, a written
    token lands in its page's slot column, and K stays row-major."""
    torch.manual_seed(3)
    pool = make_pool(dtype=torch.float8_e4m3fn, page_size=16)
    L, P, H, d, ps = pool.num_layers, pool.num_pages, pool.num_kv_heads, pool.head_dim, pool.page_size
    assert pool.v_raw.shape == (L, P, H, d, ps) and pool.v_raw.is_contiguous()
    assert pool.v.shape == pool.k.shape == (L, P, ps, H, d)
    assert pool.v.data_ptr() == pool.v_raw.data_ptr() and pool.v[0].stride(1) == 1
    assert pool.k_raw is pool.k and pool.k.is_contiguous()
    k, v = torch.randn(5, H, d), torch.randn(5, H, d)
    slots = torch.tensor([0, 17, 18, 3 * ps + 5, P * ps - 1])
    pool.write(1, slots, k, v)
    want = v.to(torch.float8_e4m3fn)  # scales are 1.0
    for t, s in enumerate(slots.tolist()):
        page, slot = divmod(s, ps)
        assert torch.equal(pool.v_raw[1, page, :, :, slot].view(torch.uint8), want[t].view(torch.uint8))
        assert torch.equal(pool.v[1, page, slot].view(torch.uint8), want[t].view(torch.uint8))
    assert int((pool.v_raw[0].view(torch.uint8) != 0).sum()) == 0  # other layers untouched
    bf16 = make_pool(dtype=torch.bfloat16)
    assert bf16.v_raw is bf16.v and bf16.v.is_contiguous()


# ---------------------------------------------------------------- prefix cache
def _filled(pool, rid, tokens):
    """A request holding ``tokens`` with its pages written (seq_len set) and cached."""
    pool.reserve(rid, len(tokens))
    pool.set_seq_len(rid, len(tokens))
    digests = pool.prefix_digests(tokens)
    return digests, pool.cache_prefix(rid, digests)


def test_prefix_digests_chain_whole_prefixes():
    pool = make_pool(page_size=4)
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(0, 1000, (14,), generator=gen).tolist()
    b = a[:8] + [x + 1 for x in a[8:]]  # same first two pages, then different
    c = [a[0] + 1] + a[1:]  # differs in the first token only
    da, db, dc = (pool.prefix_digests(x) for x in (a, b, c))
    assert len(da) == 3 and all(len(d) == 16 for d in da)  # 14 tokens: three full pages of 4
    assert db[:2] == da[:2] and db[2] != da[2]
    assert not set(dc) & set(da)  # a page's digest covers the whole prefix, not only its tokens
    assert pool.prefix_digests(torch.tensor(a)) == da and pool.prefix_digests(a[:3]) == []


def test_a_cached_prefix_is_shared_and_reference_counted():
    pool = make_pool(num_pages=10, page_size=4)
    prompt = list(range(100, 114))  # 14 tokens: pages of 4, 4, 4 cached; 2 tokens in a fourth page
    digests, added = _filled(pool, "a", prompt)
    assert added == 3 and pool.stats()["cached_pages"] == 3
    matched = pool.reserve_with_prefix("b", digests[: (len(prompt) - 1) // 4], len(prompt))
    assert matched == 12 and pool.seq_len("b") == 12
    assert pool.pages("b")[:3] == pool.pages("a")[:3] and pool.pages("b")[3] != pool.pages("a")[3]
    assert pool.free_pages == 10 - 5  # a: 4 pages, b: one new page
    pool.release("a")
    assert pool.free_pages == 10 - 4  # the shared pages stay with b; a's own fourth page is free
    pool.release("b")
    assert pool.free_pages == 10 and pool.stats()["evictable_pages"] == 3  # cached, nobody holds them
    assert pool.cached_prefix_pages(digests) == 3
    assert pool.reserve_with_prefix("c", digests[:2], 9) == 8  # an evictable page is taken back
    assert pool.stats()["evictable_pages"] == 1 and pool.free_pages == 10 - 3


def test_evictable_pages_are_reused_last_and_least_recently_released_first():
    pool = make_pool(num_pages=6, page_size=4)
    d1, _ = _filled(pool, "one", list(range(8)))  # pages cached: 2
    d2, _ = _filled(pool, "two", list(range(50, 58)))  # 2 more
    pool.release("one")
    pool.release("two")
    assert pool.free_pages == 6 and pool.stats()["evictable_pages"] == 4
    pool.reserve("x", 8)  # the 2 truly free pages first: nothing evicted
    assert pool.cached_prefix_pages(d1) == 2 and pool.cached_prefix_pages(d2) == 2
    pool.reserve("y", 4)  # now one eviction: a page of "one", released before "two"'s
    assert pool.cached_prefix_pages(d2) == 2 and pool.cached_prefix_pages(d1) < 2
    with pytest.raises(PoolExhausted):
        pool.reserve("z", 16)
    assert pool.stats()["evictable_pages"] == 3  # a failed reservation evicts nothing


def test_reserve_with_prefix_is_all_or_nothing():
    pool = make_pool(num_pages=5, page_size=4)
    digests, _ = _filled(pool, "a", list(range(12)))  # 3 pages, cached
    pool.reserve("b", 8)  # the other 2 pages
    before = pool.stats()
    with pytest.raises(PoolExhausted):
        pool.reserve_with_prefix("c", digests[:2], 20)  # 2 shared + 3 new > 0 free
    assert pool.stats() == before and not pool.has("c")
    pool.release("a")  # its 3 pages become evictable
    with pytest.raises(PoolExhausted):
        # 2 shared (evictable, taken back) + 3 new: only the third evictable page is left for them
        pool.reserve_with_prefix("c", digests[:2], 20)
    assert pool.stats()["evictable_pages"] == 3 and not pool.has("c")
    assert pool.reserve_with_prefix("c", digests[:2], 12) == 8  # 2 shared + 1 new (the third)


def test_prefix_cache_errors_and_clear():
    pool = make_pool(num_pages=8, page_size=4)
    digests, _ = _filled(pool, "a", list(range(12)))
    with pytest.raises(ValueError, match="request_id: 'a' already holds pages"):
        pool.reserve_with_prefix("a", digests, 12)
    with pytest.raises(ValueError, match="digests: 3 pages of 4 tokens are more than num_tokens"):
        pool.reserve_with_prefix("b", digests, 11)
    pool.reserve("w", 8)
    pool.set_seq_len("w", 5)
    with pytest.raises(ValueError, match="digests: 2 pages of 4 tokens are more than the 5 tokens written"):
        pool.cache_prefix("w", pool.prefix_digests(list(range(8))))
    assert pool.cache_prefix("a", digests) == 0  # cached already
    pool.release("a")
    assert pool.clear_prefix_cache() == 3
    assert pool.stats()["cached_pages"] == 0 and pool.free_pages == 8 - 2
    assert pool.reserve_with_prefix("b", digests, 12) == 0  # nothing cached any more



def test_prefix_digests_module_takes_any_int_sequence_and_checks_page_size():
    import numpy as np

    from kv_cache.prefix import prefix_digests

    tokens = list(range(37))
    want = prefix_digests(tokens, 8)
    assert len(want) == 4
    assert prefix_digests(np.array(tokens), 8) == want == make_pool(page_size=8).prefix_digests(torch.tensor(tokens))
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="page_size: expected an int >= 1"):
            prefix_digests(tokens, bad)


# ---------------------------------------------------------------- forks (n choices, copy-on-write)
def _written(pool: KVPool, rid: str, n_tokens: int, gen: torch.Generator) -> None:
    pool.reserve(rid, n_tokens)
    slots = pool.slot_mapping([rid], [0], [n_tokens])
    for layer in range(pool.num_layers):
        k = torch.randn(n_tokens, pool.num_kv_heads, pool.head_dim, generator=gen)
        v = torch.randn(n_tokens, pool.num_kv_heads, pool.head_dim, generator=gen)
        pool.write(layer, slots, k, v, backend="reference")
    pool.set_seq_len(rid, n_tokens)


def _page_bytes(pool: KVPool, page: int) -> list[bytes]:
    return [bytes(raw[layer, page].contiguous().view(torch.uint8).flatten().tolist())
            for raw in (pool.k_raw, pool.v_raw) for layer in range(pool.num_layers)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_fork_shares_full_pages_and_copies_the_partial_one(dtype):
    gen = torch.Generator().manual_seed(11)
    pool = make_pool(dtype=dtype)
    _written(pool, "p", 10, gen)  # pages 0, 1 full, page 2 holds 2 tokens
    pool.reserve("p", 14)  # reserved past seq_len: 10 tokens -> 3 pages, 14 -> 4 pages
    parent = pool.pages("p")
    assert len(parent) == 4
    free = pool.free_pages
    kids = pool.fork("p", ["c0", "c1"])
    assert pool.free_pages == free - 2  # one copied page per child, nothing else
    for kid in kids:
        assert kid[:2] == parent[:2] and kid[2] not in parent and len(kid) == 3
    assert kids[0][2] != kids[1][2]
    assert [pool.page_holders(p) for p in parent] == [3, 3, 1, 1]
    assert pool.seq_len("c0") == pool.seq_len("c1") == 10
    for kid in kids:  # the copy holds the parent's bytes, in every layer, K and V
        assert _page_bytes(pool, kid[2]) == _page_bytes(pool, parent[2])
    # a write into a child's partial page leaves the parent's and the sibling's as they were
    before_parent, before_sibling = _page_bytes(pool, parent[2]), _page_bytes(pool, kids[1][2])
    slots = pool.slot_mapping(["c0"], [10], [1])
    for layer in range(pool.num_layers):
        pool.write(layer, slots, torch.full((1, 2, 8), 3.0), torch.full((1, 2, 8), -3.0), backend="reference")
    assert _page_bytes(pool, kids[0][2]) != before_parent
    assert _page_bytes(pool, parent[2]) == before_parent and _page_bytes(pool, kids[1][2]) == before_sibling
    assert torch.equal(pool.k[:, kids[0][2], :2].float(), pool.k[:, parent[2], :2].float())  # its first slots kept


@pytest.mark.parametrize("order", [("p", "c0", "c1"), ("c0", "p", "c1"), ("c1", "c0", "p"), ("c0", "c1", "p")])
def test_fork_release_in_any_order_keeps_accounting_exact(order):
    gen = torch.Generator().manual_seed(5)
    pool = make_pool()
    start = pool.free_pages
    _written(pool, "p", 9, gen)  # 2 full pages + 1 partial
    pool.fork("p", ["c0", "c1"])
    pool.reserve("c0", 13)  # a child grows on its own
    held = {"p": 3, "c0": 4, "c1": 3}
    own = {"p": 1, "c0": 2, "c1": 1}  # pages only that request holds
    for i, rid in enumerate(order):
        free = pool.free_pages
        assert pool.release(rid) == held[rid]
        last = i == len(order) - 1
        assert pool.free_pages == free + own[rid] + (2 if last else 0)  # shared pages go with the last holder
    assert pool.free_pages == start and pool.stats()["requests"] == 0
    assert sorted(pool.manager.blocks.free) == list(range(pool.num_pages)) and not pool.manager.blocks.refs


def test_fork_of_a_page_aligned_request_copies_nothing():
    gen = torch.Generator().manual_seed(2)
    pool = make_pool()
    _written(pool, "p", 8, gen)
    free = pool.free_pages
    kids = pool.fork("p", ["a", "b", "c"])
    assert pool.free_pages == free and all(k == pool.pages("p") for k in kids)
    assert pool.reserve("a", 9)[-1] not in pool.pages("p")  # the first new token: a page of its own
    for rid in ("p", "a", "b", "c"):
        pool.release(rid)
    assert pool.free_pages == pool.num_pages


def test_fork_exhaustion_takes_nothing_and_errors():
    gen = torch.Generator().manual_seed(3)
    pool = make_pool(num_pages=4)
    _written(pool, "p", 6, gen)  # 2 pages, the second partial: 2 free
    refs, free = dict(pool.manager.blocks.refs), pool.free_pages
    with pytest.raises(PoolExhausted) as info:
        pool.fork("p", ["a", "b", "c"])
    assert info.value.requested == 3 and info.value.free == 2
    assert pool.free_pages == free and pool.manager.blocks.refs == refs and not pool.has("a")
    with pytest.raises(KeyError, match="request_id"):
        pool.fork("nope", ["a"])
    with pytest.raises(ValueError, match="child_ids"):
        pool.fork("p", ["a", "a"])
    with pytest.raises(ValueError, match="child_ids"):
        pool.fork("p", ["p"])
    pool.reserve("x", 1)
    with pytest.raises(ValueError, match="child_ids"):
        pool.fork("p", ["x"])
    pool.release("x")
    assert pool.fork("p", ["a", "b"]) and pool.free_pages == 0
