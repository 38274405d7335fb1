"""The page manager alone (kv_cache/manager.py), no tensors: allocation order, holder counts,
double frees, forks' bookkeeping, the prefix cache's eviction order, all-or-nothing exhaustion,
and the accounting invariants under a random sequence of operations."""

from __future__ import annotations

import random

import pytest

from kv_cache.manager import ForkCopy, PageManager, PoolExhausted


def _snapshot(m: PageManager) -> tuple:
    return (m.stats(), [m.page_holders(p) for p in range(m.num_pages)])


def test_allocate_hands_out_pages_in_order_and_free_gives_them_back_lifo():
    m = PageManager(num_pages=6, page_size=4)
    assert m.allocate(3) == [0, 1, 2] and m.allocate(0) == []
    assert [m.page_holders(p) for p in range(6)] == [1, 1, 1, 0, 0, 0]
    assert m.free_pages == 3 and m.used_pages == 3
    assert m.free([2, 0]) == 2
    assert m.allocate(2) == [0, 2]  # the page freed last comes back first
    assert m.pages_for(0) == 0 and m.pages_for(4) == 1 and m.pages_for(5) == 2


def test_hold_adds_a_holder_and_a_page_goes_back_with_its_last():
    m = PageManager(num_pages=4, page_size=2)
    (p,) = m.allocate(1)
    m.hold([p, p])
    assert m.page_holders(p) == 3
    assert m.free([p]) == 0 and m.free([p]) == 0 and m.page_holders(p) == 1
    assert m.free([p]) == 1 and m.page_holders(p) == 0 and m.free_pages == 4
    with pytest.raises(ValueError, match="pages: page 0 is free"):
        m.hold([p])


def test_double_free_raises_and_changes_nothing():
    m = PageManager(num_pages=4, page_size=2)
    a, b = m.allocate(2)
    m.free([a])
    before = _snapshot(m)
    with pytest.raises(ValueError, match="pages: page 0 freed 1 time"):
        m.free([a])
    with pytest.raises(ValueError, match="double free"):
        m.free([b, b])  # one holder, freed twice in one call: b keeps its holder
    with pytest.raises(ValueError, match="pages: page 3"):
        m.free([3])  # never allocated
    assert _snapshot(m) == before
    assert m.allocate(3) == [0, 2, 3]  # each free page handed out once


def test_exhaustion_takes_nothing():
    m = PageManager(num_pages=5, page_size=4)
    m.reserve("a", 8)  # pages 0, 1
    m.set_seq_len("a", 6)  # the second page partial
    before = _snapshot(m)
    with pytest.raises(PoolExhausted) as info:
        m.allocate(4)
    assert (info.value.requested, info.value.free, info.value.request_id) == (4, 3, None)
    with pytest.raises(PoolExhausted) as info:
        m.reserve("b", 13)
    assert (info.value.requested, info.value.free, info.value.request_id) == (4, 3, "b")
    with pytest.raises(PoolExhausted):
        m.reserve("a", 8 + 4 * 4)  # growth by 4 pages
    with pytest.raises(PoolExhausted):
        m.adopt("c", 16)
    with pytest.raises(PoolExhausted) as info:
        m.fork("a", ["f0", "f1", "f2", "f3"])  # one copied page each
    assert info.value.requested == 4
    with pytest.raises(PoolExhausted):
        m.reserve_with_prefix("d", [], 13)
    assert _snapshot(m) == before and m.pages("a") == [0, 1]
    assert not any(m.has(r) for r in ("b", "c", "d", "f0", "f1", "f2", "f3"))


def test_fork_shares_full_pages_and_names_the_copy():
    m = PageManager(num_pages=8, page_size=4)
    assert m.reserve("p", 16) == [0, 1, 2, 3]
    m.set_seq_len("p", 10)  # pages 0, 1 full; page 2 holds 2 tokens; page 3 reserved past seq_len
    kids, copy = m.fork("p", ["c0", "c1"])
    assert kids == [[0, 1, 4], [0, 1, 5]]
    assert copy == ForkCopy(src=2, dsts=(4, 5))
    assert [m.page_holders(p) for p in range(6)] == [3, 3, 1, 1, 1, 1]
    assert m.seq_len("c0") == m.seq_len("c1") == 10 and m.free_pages == 2
    m.set_seq_len("c1", 8)
    kids, copy = m.fork("c1", ["g"])  # page-aligned: nothing to copy, nothing allocated
    assert kids == [[0, 1]] and copy is None and m.free_pages == 2  # page 5 lies past seq_len
    assert m.fork("p", []) == ([], None)
    for rid in ("c0", "p", "g", "c1"):
        m.release(rid)
    assert m.free_pages == 8 and all(m.page_holders(p) == 0 for p in range(8))
    with pytest.raises(KeyError, match="request_id"):
        m.fork("p", ["x"])


def test_fork_child_ids_are_checked():
    m = PageManager(num_pages=4, page_size=4)
    m.reserve("p", 4)
    m.reserve("taken", 1)
    for bad in (["a", "a"], ["p"]):
        with pytest.raises(ValueError, match="child_ids: expected distinct new ids"):
            m.fork("p", bad)
    with pytest.raises(ValueError, match="child_ids: 'taken' already holds pages"):
        m.fork("p", ["a", "taken"])
    assert not m.has("a") and m.page_holders(0) == 1


def _cached(m: PageManager, rid: str, digests: list[bytes]) -> list[int]:
    pages = m.reserve(rid, len(digests) * m.page_size)
    m.set_seq_len(rid, len(digests) * m.page_size)
    assert m.cache_prefix(rid, digests) == len(digests)
    return pages


def test_prefix_eviction_takes_free_pages_first_then_least_recently_released():
    m = PageManager(num_pages=5, page_size=2)
    a = _cached(m, "a", [b"a0", b"a1"])
    b = _cached(m, "b", [b"b0", b"b1"])
    assert (a, b) == ([0, 1], [2, 3])
    m.release("b")  # evictable, least recently released first: 3, 2 (a request's last page first)
    m.release("a")  # then 1, 0
    assert m.free_pages == 5 and m.stats()["evictable_pages"] == 4
    assert m.allocate(1) == [4]  # the one never-cached page: no eviction
    assert m.cached_prefix_pages([b"a0", b"a1"]) == 2 and m.cached_prefix_pages([b"b0", b"b1"]) == 2
    assert m.allocate(1) == [3]  # b1's page
    assert m.cached_prefix_pages([b"b0", b"b1"]) == 1 and m.stats()["cached_pages"] == 3
    # taking a cached prefix back saves it from eviction
    assert m.reserve_with_prefix("a2", [b"a0", b"a1"], 4) == 4 and m.pages("a2") == [0, 1]
    assert m.allocate(1) == [2]  # b0's page: the only evictable one left
    assert m.cached_prefix_pages([b"b0"]) == 0 and m.cached_prefix_pages([b"a0", b"a1"]) == 2
    with pytest.raises(PoolExhausted):
        m.allocate(1)


def test_clear_prefix_cache_frees_evictable_pages_and_keeps_held_ones():
    m = PageManager(num_pages=4, page_size=2)
    _cached(m, "a", [b"a0"])
    _cached(m, "b", [b"b0"])
    m.release("a")
    assert m.clear_prefix_cache() == 2
    assert m.stats()["cached_pages"] == 0 and m.stats()["evictable_pages"] == 0 and m.free_pages == 3
    assert m.pages("b") == [1] and m.release("b") == 1 and m.free_pages == 4


def test_bad_arguments():
    for kwargs, name in (({"num_pages": 0, "page_size": 4}, "num_pages"), ({"num_pages": 4, "page_size": True}, "page_size"),
                         ({"num_pages": 2.0, "page_size": 4}, "num_pages")):
        with pytest.raises(ValueError, match=name):
            PageManager(**kwargs)
    m = PageManager(num_pages=4, page_size=4)
    with pytest.raises(ValueError, match="n: expected an int >= 0"):
        m.allocate(-1)
    with pytest.raises(ValueError, match="num_tokens"):
        m.reserve("a", -1)
    with pytest.raises(ValueError, match="digests"):
        m.reserve_with_prefix("a", [b"x", b"y"], 7)
    with pytest.raises(KeyError, match="request_id"):
        m.page_lists(["nobody"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_keep_the_accounting_exact(seed):
    """Every page is exactly one of free, evictable (cached, no holder) or held, and its holder
    count is the number of requests listing it, whatever the calls and their failures."""
    rng = random.Random(seed)
    m = PageManager(num_pages=12, page_size=2)
    ids = [f"r{i}" for i in range(6)]
    for _ in range(400):
        op, rid = rng.randrange(6), rng.choice(ids)
        try:
            if op == 0:
                m.reserve(rid, max(m.seq_len(rid) if m.has(rid) else 0, rng.randrange(9)))
            elif op == 1:
                m.release(rid)
            elif op == 2 and m.has(rid):
                m.set_seq_len(rid, rng.randrange(len(m.pages(rid)) * 2 + 1))
            elif op == 3 and m.has(rid):
                m.fork(rid, [c for c in rng.sample(ids, 2) if not m.has(c)])
            elif op == 4 and m.has(rid):
                full = m.seq_len(rid) // 2
                m.cache_prefix(rid, [bytes([ord(rid[1]), i]) for i in range(full)])
            elif op == 5 and not m.has(rid):
                m.reserve_with_prefix(rid, [bytes([rng.randrange(6) + ord("0"), i]) for i in range(2)], 6)
        except PoolExhausted:
            pass
        held: dict[int, int] = {}
        for r in ids:
            if m.has(r):
                for p in m.pages(r):
                    held[p] = held.get(p, 0) + 1
        free, evictable = set(m.blocks.free), set(m.blocks.evictable)
        assert len(m.blocks.free) == len(free)  # no page on the free list twice
        assert not free & evictable and not (free | evictable) & set(held)
        assert free | evictable | set(held) == set(range(m.num_pages))
        assert all(m.page_holders(p) == n for p, n in held.items())
        assert m.free_pages == len(free) + len(evictable)
        assert evictable <= set(m.blocks.digest_of) and set(m.blocks.cache.values()) == set(m.blocks.digest_of)
