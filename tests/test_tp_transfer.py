"""KV transfer between TP groups (kv_transfer/tp_transfer.py): bit-exact for 2->1, 1->2, 2->2,
4->2 and more; a corrupted frame on one rank fails the whole transfer and the retry succeeds; no
rank holds a page after a failure; the decode group's agreement over gloo."""

from __future__ import annotations

import multiprocessing
import os

import numpy as np
import pytest
import torch

from kv_cache import KVPool, KVPoolConfig
from kv_cache.heads import HeadLayout
from kv_transfer.routes import head_routes
from kv_transfer.transfer import TransferError, TransferFailure, corrupt_frame
from kv_transfer.tp_transfer import adopt_head_frames, agree, export_rank, pack_heads, transfer_groups

HQ, HKV, LAYERS, PAGE, D = 8, 4, 2, 8, 16
RID = "req"


def full_pool(dtype: torch.dtype, seed: int, tokens: int = 29) -> KVPool:
    """The TP=1 pool of one request with fresh random K/V (and per-head FP8 scales)."""
    pool = KVPool(KVPoolConfig(LAYERS, HKV, D, page_size=PAGE, dtype=dtype, num_pages=12))
    pool.reserve("filler", 10)  # the request's pages are not 0.. on the source side
    pool.reserve(RID, tokens)
    pool.set_seq_len(RID, tokens)
    pool.release("filler")
    g = torch.Generator().manual_seed(seed)
    for raw in (pool.k_raw, pool.v_raw):
        raw.view(torch.uint8).copy_(torch.randint(0, 120, raw.view(torch.uint8).shape, generator=g, dtype=torch.uint8))
    if pool.k_scale is not None:
        for layer in range(LAYERS):
            pool.set_scales(layer, 2.0 ** torch.randint(-4, 4, (HKV,), generator=g).float(),
                            2.0 ** torch.randint(-4, 4, (HKV,), generator=g).float())
    return pool


def rank_pool(full: KVPool, heads: range, *, with_request: bool) -> KVPool:
    pool = KVPool(KVPoolConfig(LAYERS, len(heads), D, page_size=PAGE, dtype=full.dtype, num_pages=12))
    if full.k_scale is not None:
        for layer in range(LAYERS):
            pool.set_scales(layer, full.k_scale[layer, list(heads)], full.v_scale[layer, list(heads)])
    if with_request:  # a prefill rank: the same pages, its heads
        pool.k_raw.copy_(full.k_raw[:, :, :, list(heads)])
        hd = 2 if full.config.v_token_major else 3
        pool.v_raw.copy_(full.v_raw.index_select(hd, torch.tensor(list(heads))))
        pool.reserve("filler", 10)
        pool.reserve(RID, full.seq_len(RID))
        pool.set_seq_len(RID, full.seq_len(RID))
        pool.release("filler")
    return pool


def groups(full: KVPool, p: int, d: int):
    src, dst = HeadLayout(HQ, HKV, p), HeadLayout(HQ, HKV, d)
    src_pools = [rank_pool(full, src.kv_heads(r), with_request=True) for r in range(p)]
    dst_pools = [rank_pool(full, dst.kv_heads(r), with_request=False) for r in range(d)]
    return src, dst, src_pools, dst_pools


def assert_rank_holds_its_heads(full: KVPool, pool: KVPool, heads: range) -> None:
    n = full.pages_for(full.seq_len(RID))
    want_pages = torch.tensor(full.pages(RID)[:n])
    got_pages = torch.tensor(pool.pages(RID)[:n])
    assert pool.seq_len(RID) == full.seq_len(RID)
    idx = torch.tensor(list(heads))
    hd = 2 if full.config.v_token_major else 3
    for part, (a, b) in enumerate(((full.k_raw, pool.k_raw), (full.v_raw, pool.v_raw))):
        want = a.view(torch.uint8).index_select(1, want_pages).index_select(hd if part else 3, idx)
        got = b.view(torch.uint8).index_select(1, got_pages)
        assert torch.equal(want, got), f"part {part} differs"


def no_pages(pools) -> bool:
    return all(p.used_pages == 0 and not p.has(RID) for p in pools)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("p, d", [(2, 1), (1, 2), (2, 2), (4, 2), (2, 4), (1, 8), (8, 2)])
def test_transfers_between_groups_are_bit_exact(p, d, dtype):
    full = full_pool(dtype, seed=10 * p + d)
    src, dst, src_pools, dst_pools = groups(full, p, d)
    assert transfer_groups(src_pools, src, dst_pools, dst, RID) == 1
    for r, pool in enumerate(dst_pools):
        assert_rank_holds_its_heads(full, pool, dst.kv_heads(r))
        pool.release(RID)
    assert no_pages(dst_pools)
    for pool in src_pools:  # the prefill ranks keep their pages until the lease ends
        assert pool.seq_len(RID) == full.seq_len(RID)
        pool.release(RID)
    assert no_pages(src_pools)


@pytest.mark.parametrize("mode", ["flip", "truncate"])
@pytest.mark.parametrize("p, d, bad", [(2, 2, (1, 1)), (2, 1, (0, 0)), (1, 2, (0, 1)), (4, 2, (2, 1))])
def test_a_corrupted_frame_on_one_rank_fails_the_whole_transfer_and_is_retried(p, d, bad, mode):
    full = full_pool(torch.float32, seed=p + 7 * d)
    src, dst, src_pools, dst_pools = groups(full, p, d)
    seen = []

    def fault(attempt, s, dd, frame):
        seen.append((attempt, s, dd))
        return corrupt_frame(frame, mode) if attempt == 0 and (s, dd) == bad else frame

    assert transfer_groups(src_pools, src, dst_pools, dst, RID, retries=1, fault=fault) == 2
    for r, pool in enumerate(dst_pools):
        assert_rank_holds_its_heads(full, pool, dst.kv_heads(r))
        pool.release(RID)
    assert no_pages(dst_pools) and {a for a, _, _ in seen} == {0, 1}
    # without a retry left, the failure reaches the caller and no decode rank holds a page
    with pytest.raises(TransferError) as info:
        transfer_groups(src_pools, src, dst_pools, dst, RID, retries=0,
                        fault=lambda a, s, dd, f: corrupt_frame(f, mode) if (s, dd) == bad else f)
    assert info.value.reason in (TransferFailure.CHECKSUM, TransferFailure.TRUNCATED) and info.value.retryable
    assert no_pages(dst_pools)
    for pool in src_pools:
        pool.release(RID)
    assert no_pages(src_pools)


def test_pool_exhausted_on_one_rank_releases_the_others():
    full = full_pool(torch.float32, seed=3)
    src, dst, src_pools, dst_pools = groups(full, 2, 2)
    dst_pools[1].reserve("other", 12 * PAGE)  # rank 1 has no room
    with pytest.raises(TransferError) as info:
        transfer_groups(src_pools, src, dst_pools, dst, RID, retries=0)
    assert info.value.reason is TransferFailure.POOL_EXHAUSTED
    assert not dst_pools[0].has(RID) and dst_pools[0].used_pages == 0
    dst_pools[1].release("other")
    assert no_pages(dst_pools)


def test_wrong_frames_are_refused_before_a_page_is_taken():
    full = full_pool(torch.float32, seed=4)
    src, dst, src_pools, dst_pools = groups(full, 2, 1)
    routes = head_routes(src, dst)
    frames = {0: export_rank(src_pools[0], RID, src, dst, 0)[0]}  # rank 1's frame is missing
    with pytest.raises(TransferError, match="expected frames from prefill ranks") as info:
        adopt_head_frames(dst_pools[0], frames, routes, RID)
    assert info.value.reason is TransferFailure.LOST
    frames[1] = pack_heads(src_pools[1], RID, [0, 1])
    with pytest.raises(TransferError) as info:
        adopt_head_frames(dst_pools[0], frames, routes, "other")
    assert info.value.reason is TransferFailure.REQUEST_MISMATCH
    frames[1] = pack_heads(src_pools[1], RID, [0])  # one head where two are expected
    with pytest.raises(TransferError) as info:
        adopt_head_frames(dst_pools[0], frames, routes, RID)
    assert info.value.reason is TransferFailure.SHAPE
    assert no_pages(dst_pools)
    with pytest.raises(ValueError, match="heads"):
        pack_heads(src_pools[0], RID, [2])
    with pytest.raises(ValueError, match="heads"):
        pack_heads(src_pools[0], RID, [0, 0])
    with pytest.raises(ValueError, match="src_pools"):
        transfer_groups(src_pools[:1], src, dst_pools, dst, RID)


def test_fp8_scales_must_match_per_head():
    full = full_pool(torch.float8_e4m3fn, seed=5)
    src, dst, src_pools, dst_pools = groups(full, 2, 1)
    dst_pools[0].set_scales(0, torch.full((HKV,), 64.0), torch.full((HKV,), 64.0))
    with pytest.raises(TransferError, match="FP8 scales") as info:
        transfer_groups(src_pools, src, dst_pools, dst, RID, retries=0)
    assert info.value.reason is TransferFailure.SHAPE and not info.value.retryable
    assert no_pages(dst_pools)


def _agree_rank(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        ok = agree(None, dist.group.WORLD)
        mine = TransferError(TransferFailure.CHECKSUM, "bad", "r") if rank == 1 else None
        verdict = agree(mine, dist.group.WORLD)
        np.save(os.path.join(out, f"{rank}.npy"), np.array([ok is None, verdict.reason.value == "checksum",
                                                             verdict.retryable]))
    finally:
        dist.destroy_process_group()


def test_the_decode_group_agrees_over_gloo(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_agree_rank, args=(r, str(tmp_path / "init"), str(tmp_path))) for r in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(120)
    assert [proc.exitcode for proc in procs] == [0, 0]
    for r in range(2):
        assert np.load(tmp_path / f"{r}.npy").tolist() == [True, True, True]
    assert agree(None) is None
    err = TransferError(TransferFailure.LOST, "x")
    assert agree(err) is err


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
@pytest.mark.parametrize("p", [2, 4, 8])
def test_merged_frames_equal_the_tp1_frame(p, dtype):
    from kv_transfer.tp_transfer import merge_frames
    from kv_transfer.transfer import adopt_frame, pack_pages, read_frame

    full = full_pool(dtype, seed=p)
    src, dst, src_pools, dst_pools = groups(full, p, 1)
    frames = {s: f for s, pool in enumerate(src_pools) for f in export_rank(pool, RID, src, dst, s).values()}
    merged = merge_frames(frames, src)
    want_header, want_payload = read_frame(pack_pages(full, RID))
    got_header, got_payload = read_frame(merged)
    assert got_header == want_header and bytes(got_payload) == bytes(want_payload)
    adopt_frame(dst_pools[0], merged, request_id=RID)  # the ordinary TP=1 receive path
    assert_rank_holds_its_heads(full, dst_pools[0], range(HKV))
    frames[0] = corrupt_frame(frames[0], "flip")
    with pytest.raises(TransferError) as info:
        merge_frames(frames, src)
    assert info.value.reason is TransferFailure.CHECKSUM
    with pytest.raises(TransferError, match="expected frames from prefill ranks"):
        merge_frames({0: frames[0]}, src)
