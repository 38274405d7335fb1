"""The receive side of a TP decode replica (kv_transfer/tp_transfer.py ``split_frame``,
``adopt_rank_frame``, ``settle``; no Ray): an ordinary frame split by KV head lands bit-exact
on every decode rank (with replicated heads too, FP8 scales per head), a damaged frame never
reaches a rank, and a damaged split on one rank releases the request on all of them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kv_cache.heads import HeadLayout
from kv_transfer.transfer import TransferError, TransferFailure, corrupt_frame, pack_pages, read_frame
from kv_transfer.tp_transfer import adopt_rank_frame, export_rank, rank_routes, settle, split_frame
from tests.test_tp_transfer import HKV, HQ, RID, assert_rank_holds_its_heads, full_pool, no_pages, rank_pool


def receive(frame, dst: HeadLayout, pools, *, damage=None) -> None:
    """What ``serving.tp_group``'s receiver does, with the ranks' pools in this process."""
    frames = split_frame(frame, dst, request_id=RID)
    if damage is not None:
        rank, mode = damage
        frames[rank] = corrupt_frame(frames[rank], mode)
    outcomes = [adopt_rank_frame(pool, frames[r], dst, r, RID) for r, pool in enumerate(pools)]
    settle(outcomes, lambda: [pool.release(RID) for pool in pools])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("d", [1, 2, 4, 8])  # 8 > HKV: each KV head replicated on two ranks
def test_a_split_frame_lands_bit_exact_on_every_rank(d, dtype):
    full = full_pool(dtype, seed=40 + d)
    dst = HeadLayout(HQ, HKV, d)
    pools = [rank_pool(full, dst.kv_heads(r), with_request=False) for r in range(d)]
    receive(pack_pages(full, RID), dst, pools)
    for r, pool in enumerate(pools):
        assert_rank_holds_its_heads(full, pool, dst.kv_heads(r))
        pool.release(RID)
    assert no_pages(pools)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_split_frames_are_the_frames_a_tp1_prefill_rank_exports_to_each_decode_rank(dtype):
    full = full_pool(dtype, seed=7)
    dst = HeadLayout(HQ, HKV, 2)
    want = export_rank(full, RID, HeadLayout(HQ, HKV, 1), dst, 0)  # packed from the pool itself
    got = split_frame(pack_pages(full, RID), dst)
    assert sorted(got) == [0, 1]
    for r in (0, 1):
        assert np.array_equal(got[r], want[r])
        header, _ = read_frame(got[r])  # its own CRC and its heads' scales
        assert header.num_kv_heads == HKV // 2
        if dtype == torch.float8_e4m3fn:
            heads = list(dst.kv_heads(r))
            assert header.k_scale == tuple(float(x) for x in full.k_scale[:, heads].flatten().tolist())


@pytest.mark.parametrize("mode", ["flip", "truncate"])
@pytest.mark.parametrize("d, bad", [(2, 1), (2, 0), (4, 2), (8, 7)])
def test_a_damaged_split_on_one_rank_releases_every_rank_and_the_retry_succeeds(d, bad, mode):
    full = full_pool(torch.float32, seed=3 * d + bad)
    dst = HeadLayout(HQ, HKV, d)
    pools = [rank_pool(full, dst.kv_heads(r), with_request=False) for r in range(d)]
    for pool in pools:
        pool.reserve("other", 9)  # a request already decoding there keeps its pages
    frame = pack_pages(full, RID)
    with pytest.raises(TransferError) as err:
        receive(frame, dst, pools, damage=(bad, mode))
    want = TransferFailure.CHECKSUM if mode == "flip" else TransferFailure.TRUNCATED
    assert err.value.reason is want and err.value.retryable
    assert all(not p.has(RID) and p.used_pages == p.pages_for(9) for p in pools)
    receive(frame, dst, pools)  # the ingress prefills again: the same pages come again
    for r, pool in enumerate(pools):
        assert_rank_holds_its_heads(full, pool, dst.kv_heads(r))


def test_pool_exhausted_on_one_rank_releases_the_others():
    full = full_pool(torch.float32, seed=11)
    dst = HeadLayout(HQ, HKV, 2)
    pools = [rank_pool(full, dst.kv_heads(r), with_request=False) for r in range(2)]
    pools[1].reserve("hog", pools[1].num_pages * 8 - 8)  # one page left there
    with pytest.raises(TransferError) as err:
        receive(pack_pages(full, RID), dst, pools)
    assert err.value.reason is TransferFailure.POOL_EXHAUSTED
    assert not pools[0].has(RID) and pools[0].used_pages == 0 and not pools[1].has(RID)


def test_a_damaged_frame_is_refused_before_it_is_split():
    full = full_pool(torch.float32, seed=5)
    frame = pack_pages(full, RID)
    dst = HeadLayout(HQ, HKV, 2)
    for mode, reason in (("flip", TransferFailure.CHECKSUM), ("truncate", TransferFailure.TRUNCATED)):
        with pytest.raises(TransferError) as err:
            split_frame(corrupt_frame(frame, mode), dst)
        assert err.value.reason is reason
    with pytest.raises(TransferError) as err:
        split_frame(frame, dst, request_id="another")
    assert err.value.reason is TransferFailure.REQUEST_MISMATCH
    with pytest.raises(TransferError) as err:
        split_frame(frame, HeadLayout(HQ, HKV // 2, 2))  # a decode group of another model
    assert err.value.reason is TransferFailure.SHAPE
    with pytest.raises(ValueError, match="dst"):
        split_frame(frame, 2)


def test_a_rank_refuses_a_split_of_another_group_or_request_without_taking_a_page():
    full = full_pool(torch.float32, seed=6)
    dst = HeadLayout(HQ, HKV, 4)
    pool = rank_pool(full, dst.kv_heads(1), with_request=False)
    two = split_frame(pack_pages(full, RID), HeadLayout(HQ, HKV, 2))  # 2 heads per frame, this rank holds 1
    assert adopt_rank_frame(pool, two[0], dst, 1, RID).reason is TransferFailure.SHAPE
    frames = split_frame(pack_pages(full, RID), dst)
    assert adopt_rank_frame(pool, frames[1], dst, 1, "other").reason is TransferFailure.REQUEST_MISMATCH
    assert not pool.has(RID) and not pool.has("other") and pool.used_pages == 0
    with pytest.raises(ValueError, match="rank"):
        rank_routes(dst, 4)


def test_settle_releases_only_on_a_failure_and_raises_the_lowest_rank_s_reason():
    released = []
    settle([None, None], lambda: released.append(1))
    assert released == []
    first = TransferError(TransferFailure.CHECKSUM, "bad", RID)
    second = TransferError(TransferFailure.POOL_EXHAUSTED, "full", RID)
    with pytest.raises(TransferError) as err:
        settle([None, first, second], lambda: released.append(1))
    assert err.value is first and released == [1]


class InProcessGroup:
    """A ``kv_transfer.group.RankGroup`` whose followers are pools in this process: their ends
    are built from the registry as a rank actor's ``call_end`` builds them."""

    timeout_s = 10.0

    def __init__(self, pools, layout: HeadLayout) -> None:
        self.pools, self.pool, self.layout = pools, pools[0], layout
        self.ends, self.failures, self.released = {}, [], []

    @property
    def size(self) -> int:
        return self.layout.tp_size

    def submit(self, rank, end, method, *args):
        import concurrent.futures

        from kv_transfer.registry import get_transport
        from kv_transfer.spec import RankContext

        key = (rank, end.transport, end.role)
        if key not in self.ends:
            context = RankContext(self.pools[rank], self.layout, rank, end.setup)
            self.ends[key] = get_transport(end.transport).rank_end(end.role, context)
        future = concurrent.futures.Future()
        try:
            future.set_result(getattr(self.ends[key], method)(*args))
        except BaseException as exc:  # noqa: BLE001 - handed back as the call's outcome
            future.set_exception(exc)
        return future

    def results(self, handles, timeout_s):
        return [h.result(timeout_s) for h in handles]

    def wait(self, handles, timeout_s):
        pass

    def release(self, request_id):
        self.released.append(request_id)
        for pool in self.pools:
            if pool.has(request_id):
                pool.release(request_id)

    def report_failure(self, exc):
        self.failures.append(exc)


@pytest.mark.parametrize("d", [2, 4])
def test_the_object_store_group_receiver_adopts_on_every_rank_through_the_rank_group(d):
    """kv_transfer.object_store.group: the leader's receiver and the followers' ``FrameRankEnd``
    (built from the registry), all or nothing; a damaged last split (the drill) releases all."""
    from kv_transfer.registry import get_transport
    from kv_transfer.spec import BuildContext

    full = full_pool(torch.float32, seed=60 + d)
    dst = HeadLayout(HQ, HKV, d)
    pools = [rank_pool(full, dst.kv_heads(r), with_request=False) for r in range(d)]
    group = InProcessGroup(pools, dst)
    receiver = get_transport("object_store").build_receiver(
        BuildContext("cpu", group=group, fault_mode="flip", rank_faults=1, options={"object_store": {}}))
    with pytest.raises(TransferError) as info:  # the first transfer: the drill damages rank d-1's split
        receiver.adopt(RID, pack_pages(full, RID))
    assert info.value.reason is TransferFailure.CHECKSUM and group.released == [RID] and no_pages(pools)
    pages = receiver.adopt(RID, pack_pages(full, RID))  # the retry
    assert pages == pools[0].pages(RID) and group.failures == []
    for r, pool in enumerate(pools):
        assert_rank_holds_its_heads(full, pool, dst.kv_heads(r))
    assert {key[1:] for key in group.ends} == {("object_store", "receive")}
