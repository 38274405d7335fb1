"""Pairwise KV channels (kv_transfer.channel) over gloo on CPU: the code path NCCL runs on GPUs.

Sender and receiver are a ChannelSender and a ChannelReceiver in this process (worker threads
run each end of the process group) and, for a peer that really dies, a sender in a child process. The
receiver reaches the sender through ``call_sender``, which the service implements as a Serve
call pinned to the prefill replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import time
from dataclasses import replace

import pytest
import torch

import kv_transfer.channel.recv as recv_module
from kv_transfer.channel.recv import ChannelReceiver, _Fence
from kv_transfer.channel.send import ChannelSender
from kv_transfer.channel.config import ChannelConfig
from kv_transfer.channel.pages import gather_pages, payload_checksum, scatter_pages
from kv_transfer.channel.process_group import Channel, ChannelBroken
from kv_transfer.transfer import KVFrameHeader, TransferError, TransferFailure, TransferTicket
from kv_transfer.wire import SendPages
from tests.test_kv_transfer import fill, make_pool, tokens_of

FAST = ChannelConfig(connect_timeout_s=2.0, transfer_timeout_s=1.0, idle_reopen_s=60.0)


class Pair:
    """A sender and a receiver transport; ``calls`` records what the receiver asked."""

    def __init__(self, config: ChannelConfig = FAST, call=None) -> None:
        self.sender = ChannelSender("cpu", identity={"replica_id": "P"}, config=config)
        self.calls: list[dict] = []
        self.replies: list[dict] = []

        async def call_sender(sender: dict, request: dict) -> dict:
            self.calls.append(request)
            if call is not None:
                return await call(sender, request)
            reply = await self.sender.serve_send(request)
            self.replies.append(reply)
            return reply

        self.receiver = ChannelReceiver("cpu", identity={"replica_id": "D"}, call_sender=call_sender, config=config)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()
        # Pairs torn down and rebuilt back to back in one process now and then stall the next
        # pair's store connection for the whole connect timeout (about 1 in 12 pairs here, with
        # the channel code before the chunk pipeline too; cause not found, not a transfer
        # error). A short pause between pairs keeps this file deterministic.
        time.sleep(0.1)


@pytest.fixture
def pair():
    p = Pair()
    yield p
    p.close()


def run(coro):
    return asyncio.run(coro)


def assert_same_tokens(src, dst, rid):
    for a, b in zip(tokens_of(src, rid), tokens_of(dst, rid)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ----------------------------------------------------------------------------- transfers
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
def test_pages_arrive_bit_exact_over_one_reused_channel(pair, dtype):
    src, dst = make_pool(dtype=dtype), make_pool(dtype=dtype)
    if dtype == torch.float8_e4m3fn:  # the header carries the scales; they must match
        for pool in (src, dst):
            for layer in range(pool.num_layers):
                pool.set_scales(layer, torch.tensor([0.5, 2.0]), torch.tensor([0.25, 4.0]))
    dst.reserve("other", 10)  # the receiver's page ids differ from the sender's
    for i, n in enumerate((1, 8, 21)):
        rid = f"r{i}"
        fill(src, rid, n, seed=100 + n)
        ticket = pair.sender.export(src, rid)
        assert ticket.transport == "gloo" and ticket.num_tokens == n and ticket.num_pages == -(-n // 8)
        pages = run(pair.receiver.receive(ticket, dst))
        assert pages == dst.pages(rid) and dst.seq_len(rid) == n and src.has(rid)  # sender keeps its pages
        assert_same_tokens(src, dst, rid)
    assert pair.receiver.counters()["channel_receives"] == 3 and pair.sender.counters()["channel_sends"] == 3
    assert pair.receiver.counters()["channels_opened"] == 1 == pair.sender.counters()["channels_opened"]
    assert pair.sender.counters()["channel_staged"] == 0  # exports are forgotten once sent
    assert [c.generation for c in pair.calls] == [1, 1, 1]


def test_concurrent_transfers_of_one_pair_take_turns(pair):
    src, dst = make_pool(num_pages=32), make_pool(num_pages=32)
    rids = [f"c{i}" for i in range(4)]
    for i, rid in enumerate(rids):
        fill(src, rid, 5 + 6 * i, seed=i)

    async def all_at_once():
        tickets = [pair.sender.export(src, rid) for rid in rids]
        return await asyncio.gather(*(pair.receiver.receive(t, dst) for t in tickets))

    run(all_at_once())
    for rid in rids:
        assert_same_tokens(src, dst, rid)
    assert pair.receiver.counters()["channels_opened"] == 1


def test_empty_request(pair):
    src, dst = make_pool(), make_pool()
    src.reserve("e", 0)
    assert run(pair.receiver.receive(pair.sender.export(src, "e"), dst)) == [] and dst.has("e")


def test_idle_channel_is_reopened_and_the_old_generation_dropped():
    p = Pair(dataclasses.replace(FAST, idle_reopen_s=0.05))
    try:
        src, dst = make_pool(), make_pool()
        fill(src, "a", 9)
        fill(src, "b", 9, seed=1)
        run(p.receiver.receive(p.sender.export(src, "a"), dst))
        time.sleep(0.1)
        run(p.receiver.receive(p.sender.export(src, "b"), dst))
        assert [c.generation for c in p.calls] == [1, 2]
        assert p.sender.counters()["channels_open"] == 1 and p.receiver.counters()["channels_open"] == 1
        assert_same_tokens(src, dst, "b")
    finally:
        p.close()


# ----------------------------------------------------------------------------- chunks
def _chunk_reference(pool, pages, l0, l1) -> bytes:
    """Layers [l0, l1) of ``pages``, K then V, by plain indexing (not the code under test)."""
    idx = torch.tensor(pages, dtype=torch.long)
    parts = [t[l0:l1][:, idx].contiguous().view(-1).view(torch.uint8) for t in (pool.k, pool.v)]
    return bytes(torch.cat(parts).tolist())


LAYER_BYTES = 2 * 8 * 2 * 4 * 4  # K+V of one 8-token page of one layer: make_pool's fp32 geometry


# (layers, tokens, chunk_bytes, ring_depth, the chunks' layer ranges)
CHUNKINGS = [
    (7, 21, 2 * 3 * LAYER_BYTES, 2, [(0, 2), (2, 4), (4, 6), (6, 7)]),  # more chunks than slots, a short last one
    (7, 8, 1, 3, [(i, i + 1) for i in range(7)]),  # one page; below one layer: one layer per chunk
    (1, 21, 1, 2, [(0, 1)]),  # one layer
    (5, 17, 3 * 3 * LAYER_BYTES - 1, 1, [(0, 2), (2, 4), (4, 5)]),  # ring depth 1: one step after the other
    (4, 30, 10**9, 3, [(0, 4)]),  # the whole request in one chunk
]


@pytest.mark.parametrize("layers,tokens,chunk_bytes,depth,ranges", CHUNKINGS)
def test_multi_chunk_transfers_are_bit_exact_with_per_chunk_checksums(layers, tokens, chunk_bytes, depth, ranges):
    p = Pair(dataclasses.replace(FAST, chunk_bytes=chunk_bytes, ring_depth=depth))
    try:
        src, dst = make_pool(num_layers=layers), make_pool(num_layers=layers)
        dst.reserve("other", 9)  # the receiver's page ids differ from the sender's
        fill(src, "r", tokens, seed=tokens + layers)
        pages = run(p.receiver.receive(p.sender.export(src, "r"), dst))
        assert pages == dst.pages("r") and dst.seq_len("r") == tokens and pages != src.pages("r")
        assert_same_tokens(src, dst, "r")
        assert p.calls[0].layers_per_chunk == ranges[0][1]
        want = [_reference_checksum(_chunk_reference(src, src.pages("r"), l0, l1)) for l0, l1 in ranges]
        assert p.replies[0].ok and list(p.replies[0].checksums) == want
        assert p.sender.counters()["channel_staged"] == 0 and p.receiver.counters()["channel_failures"] == 0
    finally:
        p.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_multi_chunk_narrow_dtypes(dtype):
    p = Pair(dataclasses.replace(FAST, chunk_bytes=1, ring_depth=2))
    try:
        src, dst = make_pool(dtype=dtype, num_layers=5, head_dim=8), make_pool(dtype=dtype, num_layers=5, head_dim=8)
        g = torch.Generator().manual_seed(3)
        for t in (src.k, src.v):  # every bit pattern, NaN encodings included: a copy must keep them all
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8, generator=g))
        src.reserve("r", 19)
        src.set_seq_len("r", 19)
        run(p.receiver.receive(p.sender.export(src, "r"), dst))
        assert len(p.replies[0].checksums) == 5
        for a, b in ((src.k, dst.k), (src.v, dst.v)):
            assert torch.equal(a[:, src.pages("r")].view(torch.uint8), b[:, dst.pages("r")].view(torch.uint8))
    finally:
        p.close()


def test_export_copies_nothing_the_send_reads_the_pool():
    """The pages travel as they are when the decode side asks, not as they were at export."""
    p = Pair(dataclasses.replace(FAST, chunk_bytes=1))
    try:
        src, dst = make_pool(), make_pool()
        fill(src, "r", 13, seed=1)
        ticket = p.sender.export(src, "r")
        assert p.sender.counters()["channel_staged"] == 1
        before = [t.clone() for t in tokens_of(src, "r")]
        src.release("r")
        fill(src, "r", 13, seed=2)  # same pages (LIFO), new contents
        run(p.receiver.receive(ticket, dst))
        assert_same_tokens(src, dst, "r")
        assert not torch.equal(before[0], tokens_of(dst, "r")[0])
        assert p.sender.counters()["channel_staged"] == 0
    finally:
        p.close()


def test_corrupt_middle_chunk_is_caught_and_no_page_leaks():
    p = Pair(dataclasses.replace(FAST, chunk_bytes=1, ring_depth=2))
    try:
        src, dst = make_pool(num_layers=5), make_pool(num_layers=5)
        fill(src, "r", 20, seed=4)
        with pytest.raises(TransferError, match=r"chunk 2 of 5 \(layers 2\.\.2\)") as info:
            run(p.receiver.receive(p.sender.export(src, "r", fault="flip"), dst))
        assert info.value.reason is TransferFailure.CHECKSUM and info.value.retryable
        assert dst.free_pages == dst.num_pages and not dst.has("r") and src.has("r")
        # every chunk was scattered before the comparison: the freed pages were zeroed again
        assert not dst.k.any() and not dst.v.any()
        sums = list(p.replies[0].checksums)
        want = [_reference_checksum(_chunk_reference(src, src.pages("r"), i, i + 1)) for i in range(5)]
        assert sums == want  # the sender's checksums are of the data before the flip
        run(p.receiver.receive(p.sender.export(src, "r"), dst))  # a new generation
        assert_same_tokens(src, dst, "r")
    finally:
        p.close()


def test_lease_ending_during_the_send_fails_the_transfer(monkeypatch):
    """The prefill replica discards the export (its lease ended) while the chunks go out: the
    pages may be another request's by then, so the send answers LOST and nothing is kept."""
    p = Pair(dataclasses.replace(FAST, chunk_bytes=1))
    try:
        src, dst = make_pool(), make_pool()
        fill(src, "r", 12)
        ticket = p.sender.export(src, "r")
        real = p.sender._send_chunks

        def discard_midway(channel, req, exp, deadline):
            p.sender.discard(ticket)
            return real(channel, req, exp, deadline)

        monkeypatch.setattr(p.sender, "_send_chunks", discard_midway)
        with pytest.raises(TransferError, match="lease on the pages ended") as info:
            run(p.receiver.receive(ticket, dst))
        assert info.value.reason is TransferFailure.LOST
        assert dst.free_pages == dst.num_pages and not dst.k.any() and not dst.v.any()
        assert p.sender.counters()["channel_staged"] == 0 and p.sender.counters()["channel_failures"] == 1
    finally:
        p.close()


def test_receive_given_up_mid_scatter_frees_its_pages_once_the_write_ends(monkeypatch):
    """The request goes away while a chunk is being scattered: its pages leave the request at
    once but return to the pool (zeroed) only after that write, from the receiving worker."""
    import threading

    p = Pair(dataclasses.replace(FAST, chunk_bytes=1, ring_depth=2))
    inside, go = threading.Event(), threading.Event()
    real = recv_module.scatter_pages

    def slow_scatter(pool, pages, payload, layers=None):
        if layers == (1, 2):
            inside.set()
            assert go.wait(10)
        real(pool, pages, payload, layers)

    monkeypatch.setattr(recv_module, "scatter_pages", slow_scatter)
    try:
        src, dst = make_pool(), make_pool()
        fill(src, "r", 17, seed=9)

        async def give_up():
            task = asyncio.ensure_future(p.receiver.receive(p.sender.export(src, "r"), dst))
            assert await asyncio.to_thread(inside.wait, 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task

        run(give_up())
        held = dst.num_pages - dst.free_pages
        assert not dst.has("r") and held == 3 and dst.stats()["requests"] == 1  # under a private id
        go.set()
        deadline = time.monotonic() + 10
        while dst.free_pages != dst.num_pages and time.monotonic() < deadline:
            time.sleep(0.01)
        assert dst.free_pages == dst.num_pages and dst.stats()["requests"] == 0
        assert not dst.k.any() and not dst.v.any()
    finally:
        go.set()
        p.close()


def test_fence_decides_who_frees_the_pages():
    pool = make_pool()
    # nothing written: safe at once, and no later write may start
    f = _Fence()
    pool.adopt("a", 9)
    assert f.abandon(pool, "a") == _Fence.SAFE and pool.has("a") and not f.touched
    with pytest.raises(ChannelBroken):
        f.begin_write()
    # a write under way: the pages move aside and the worker frees them on exit
    f = _Fence()
    pages = pool.adopt("b", 9)
    f.begin_write()
    assert f.abandon(pool, "b") == _Fence.WORKER and not pool.has("b")
    f.end_write(None)
    handoff = f.exit()
    assert handoff is not None and handoff[0] is pool and pool.pages(handoff[1]) == pages and f.touched
    # the worker left with a write it could not stop: nobody frees them
    f = _Fence()
    pool.adopt("c", 9)
    f.begin_write()
    assert f.exit() is None
    assert f.abandon(pool, "c") == _Fence.STUCK and not pool.has("c") and f.pending()
    # written and finished: safe
    f = _Fence()
    pool.adopt("d", 9)
    f.begin_write()
    f.end_write(None)
    assert f.exit() is None and f.abandon(pool, "d") == _Fence.SAFE and f.touched and pool.has("d")


# ----------------------------------------------------------------------------- checksum
def _reference_checksum(data: bytes) -> int:
    """The documented formula in plain Python integers (independent of the torch code)."""
    def s32(x):  # an int32 sum as the device keeps it: mod 2**32, signed
        x &= 0xFFFFFFFF
        return x - (1 << 32) if x >= 1 << 31 else x

    words = [int.from_bytes(data[i : i + 4], "little", signed=True) for i in range(0, len(data) // 4 * 4, 4)]
    tail = data[len(words) * 4 :]
    total = 0
    if words:
        cols = min(1024, len(words))
        rows = len(words) // cols
        grid = [words[r * cols : (r + 1) * cols] for r in range(rows)]
        total += sum((r + 1) * s32(sum(row)) for r, row in enumerate(grid))
        total += 0x100000001B3 * sum((c + 1) * s32(sum(grid[r][c] for r in range(rows))) for c in range(cols))
        total += 0x9E3779B1 * sum((k + 1) * w for k, w in enumerate(words[rows * cols :]))
    total += 0x85EBCA77 * sum((k + 1) * b for k, b in enumerate(tail))
    return total & ((1 << 64) - 1)


@pytest.mark.parametrize("nbytes", [0, 3, 4 * 7, 4 * 1024 * 3 + 4 * 5 + 3])
def test_checksum_matches_the_documented_formula(nbytes):
    g = torch.Generator().manual_seed(nbytes)
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    assert payload_checksum(payload) == _reference_checksum(bytes(payload.tolist()))


def test_checksum_sees_flips_and_reordering():
    g = torch.Generator().manual_seed(7)
    payload = torch.randint(0, 256, (4 * 1024 * 4 + 4 * 9 + 2,), dtype=torch.uint8, generator=g)
    base = payload_checksum(payload)
    assert payload_checksum(payload.clone()) == base
    for pos in (0, 4095, 4096 * 2 + 17, payload.numel() - 10, payload.numel() - 1):  # rows, leftover words, tail
        bad = payload.clone()
        bad[pos] ^= 0x01
        assert payload_checksum(bad) != base, pos
    words = payload[: 4 * 1024 * 4].view(torch.int32).view(4, 1024)
    swapped_rows = payload.clone()
    swapped_rows[: 4 * 1024 * 4].view(torch.int32).view(4, 1024)[[0, 2]] = words[[2, 0]]
    assert payload_checksum(swapped_rows) != base  # pages in the wrong order
    swapped_words = payload.clone()
    grid = swapped_words[: 4 * 1024 * 4].view(torch.int32).view(4, 1024)
    grid[1, 3], grid[1, 700] = words[1, 700].clone(), words[1, 3].clone()
    assert payload_checksum(swapped_words) != base


def test_checksum_rejects_bad_payloads():
    for bad in (torch.zeros(8, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.uint8), "bytes"):
        with pytest.raises(ValueError, match="payload"):
            payload_checksum(bad)
    with pytest.raises(ValueError, match="contiguous"):
        payload_checksum(torch.zeros(16, dtype=torch.uint8)[::2])


def test_gather_scatter_layer_ranges_and_buffers():
    src, dst = make_pool(num_layers=5), make_pool(num_layers=5)
    fill(src, "r", 19, seed=2)
    dst.adopt("r", 19)
    buf = torch.full((10_000,), 7, dtype=torch.uint8)
    for l0, l1 in ((0, 2), (2, 3), (3, 5)):
        buf.fill_(7)
        chunk = gather_pages(src, src.pages("r"), (l0, l1), out=buf)
        assert chunk.data_ptr() == buf.data_ptr() and bytes(chunk.tolist()) == _chunk_reference(src, src.pages("r"), l0, l1)
        assert (buf[chunk.numel():] == 7).all()  # nothing past the chunk is written
        scatter_pages(dst, dst.pages("r"), chunk.clone(), (l0, l1))
    assert_same_tokens(src, dst, "r")


def test_gather_scatter_reject_bad_arguments():
    pool = make_pool()
    fill(pool, "r", 10)
    pages = pool.pages("r")
    for bad in ((0, 0), (2, 1), (0, 4), (-1, 2), [0, 1], (0, 1.0), 2):
        with pytest.raises(ValueError, match="layers"):
            gather_pages(pool, pages, bad)
        with pytest.raises(ValueError, match="layers"):
            scatter_pages(pool, pages, torch.zeros(0, dtype=torch.uint8), bad)
    need = 2 * 1 * 2 * 8 * 2 * 4 * 4  # K+V, one layer, two pages
    for bad in (torch.zeros(need - 1, dtype=torch.uint8), torch.zeros(need, dtype=torch.int8),
                torch.zeros(2, need, dtype=torch.uint8), torch.zeros(2 * need, dtype=torch.uint8)[::2], "buf"):
        with pytest.raises(ValueError, match="out"):
            gather_pages(pool, pages, (0, 1), out=bad)
    for bad in (torch.zeros(need - 1, dtype=torch.uint8), torch.zeros(need + 1, dtype=torch.uint8),
                torch.zeros(need // 4, dtype=torch.float32)):
        with pytest.raises(ValueError, match="payload"):
            scatter_pages(pool, pages, bad, (0, 1))
    if torch.device("meta") != pool.device:  # a buffer on another device
        with pytest.raises(ValueError, match="device"):
            gather_pages(pool, pages, (0, 1), out=torch.zeros(need, dtype=torch.uint8, device="meta"))


def test_gather_scatter_roundtrip():
    src, dst = make_pool(dtype=torch.bfloat16), make_pool(dtype=torch.bfloat16)
    fill(src, "r", 19)
    payload = gather_pages(src, src.pages("r"))
    assert payload.numel() == 2 * src.num_layers * 3 * src.page_size * src.num_kv_heads * src.head_dim * 2
    dst.adopt("r", 19)
    scatter_pages(dst, dst.pages("r"), payload)
    assert_same_tokens(src, dst, "r")


# ----------------------------------------------------------------------------- failures
def test_checksum_mismatch_frees_pages_and_rebuilds_the_channel(pair):
    src, dst = make_pool(), make_pool()
    fill(src, "r", 20)
    with pytest.raises(TransferError) as info:
        run(pair.receiver.receive(pair.sender.export(src, "r", fault="flip"), dst))
    assert info.value.reason is TransferFailure.CHECKSUM and info.value.retryable
    assert dst.free_pages == dst.num_pages and not dst.has("r") and src.has("r")
    assert pair.receiver.counters()["channel_failures"] == 1 and pair.receiver.counters()["channels_open"] == 0
    run(pair.receiver.receive(pair.sender.export(src, "r"), dst))  # a new generation on both ends
    assert [c.generation for c in pair.calls] == [1, 2]
    assert pair.sender.counters()["channels_opened"] == 2 and pair.sender.counters()["channels_open"] == 1
    assert_same_tokens(src, dst, "r")


def test_broken_channel_fails_fast_and_frees_pages(pair):
    src, dst = make_pool(), make_pool()
    fill(src, "r", 12)
    t0 = time.monotonic()
    with pytest.raises(TransferError) as info:
        run(pair.receiver.receive(pair.sender.export(src, "r", fault="break"), dst))
    assert info.value.reason is TransferFailure.LOST and info.value.retryable
    assert time.monotonic() - t0 < FAST.connect_timeout_s
    assert dst.free_pages == dst.num_pages and pair.sender.counters()["channel_failures"] == 1


def test_sender_without_the_pages_answers_lost(pair):
    src, dst = make_pool(), make_pool()
    fill(src, "r", 12)
    ticket = pair.sender.export(src, "r")
    pair.sender.discard(ticket)  # the lease ended before the decode side asked
    t0 = time.monotonic()
    with pytest.raises(TransferError, match="no exported pages") as info:
        run(pair.receiver.receive(ticket, dst))
    assert info.value.reason is TransferFailure.LOST and time.monotonic() - t0 < FAST.connect_timeout_s
    assert dst.free_pages == dst.num_pages


def test_silent_peer_times_out_and_frees_pages():
    async def never(sender, request):
        await asyncio.sleep(3600)

    cfg = ChannelConfig(connect_timeout_s=0.5, transfer_timeout_s=0.5)
    p = Pair(cfg, call=never)
    try:
        src, dst = make_pool(), make_pool()
        fill(src, "r", 12)
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:  # the rendezvous (or the wait for the reply) times out
            run(p.receiver.receive(p.sender.export(src, "r"), dst))
        elapsed = time.monotonic() - t0
        assert info.value.reason is TransferFailure.LOST and info.value.retryable
        assert elapsed < 0.5 + 0.5 + 0.5 + 2.0  # connect + transfer + reply grace, plus slack
        assert dst.free_pages == dst.num_pages and p.receiver.counters()["channels_open"] == 0
    finally:
        p.close()


def test_a_stuck_channel_does_not_hold_up_other_senders():
    cfg = ChannelConfig(connect_timeout_s=2.0, transfer_timeout_s=1.0)
    quick = ChannelSender("cpu", identity={"replica_id": "Q"}, config=cfg)
    silent = ChannelSender("cpu", identity={"replica_id": "S"}, config=cfg)

    async def call_sender(sender, request):
        if sender["replica_id"] == "S":  # never joins: the receiver's rendezvous waits it out
            await asyncio.sleep(3600)
        return await quick.serve_send(request)

    receiver = ChannelReceiver("cpu", identity={"replica_id": "D"}, call_sender=call_sender, config=cfg)
    src_q, src_s, dst = make_pool(), make_pool(), make_pool()
    fill(src_q, "q", 10)
    fill(src_s, "s", 10, seed=1)

    async def both():
        stuck = asyncio.ensure_future(receiver.receive(silent.export(src_s, "s"), dst))
        await asyncio.sleep(0.2)  # the silent channel's rendezvous is under way
        t0 = time.monotonic()
        await receiver.receive(quick.export(src_q, "q"), dst)
        elapsed = time.monotonic() - t0
        with pytest.raises(TransferError):
            await stuck
        return elapsed

    try:
        assert run(both()) < 1.0
        assert_same_tokens(src_q, dst, "q") and not dst.has("s")
    finally:
        for t in (quick, silent, receiver):
            t.close()


def test_unreachable_sender_answers_lost():
    async def gone(sender, request):
        raise ConnectionError("replica died")

    p = Pair(FAST, call=gone)
    try:
        src, dst = make_pool(), make_pool()
        fill(src, "r", 3)
        with pytest.raises(TransferError, match="ConnectionError") as info:
            run(p.receiver.receive(p.sender.export(src, "r"), dst))
        assert info.value.reason is TransferFailure.LOST and dst.free_pages == dst.num_pages
    finally:
        p.close()


def _dying_sender(conn) -> None:
    """Child process: a sender that serves one transfer, then dies when asked for the next."""
    src = make_pool()
    fill(src, "r", 21, seed=5)
    fill(src, "s", 9, seed=6)
    sender = ChannelSender("cpu", identity={"replica_id": "child"}, config=FAST)
    conn.send([sender.export(src, "r"), sender.export(src, "s")])
    conn.send(asyncio.run(sender.serve_send(conn.recv())))
    conn.recv()  # the receiver has posted its receive on the open channel...
    os._exit(0)  # ...and the sender dies instead of sending


def test_peer_process_dying_mid_transfer_is_lost_within_the_timeout():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_dying_sender, args=(child,), daemon=True)
    proc.start()
    child.close()  # the child's end lives in the child only: its death is EOF here
    try:
        ticket_r, ticket_s = parent.recv()

        async def call_sender(sender, request):
            parent.send(request)
            return await asyncio.to_thread(parent.recv)  # EOFError once the child is gone

        receiver = ChannelReceiver("cpu", identity={"replica_id": "D"}, call_sender=call_sender, config=FAST)
        dst = make_pool()
        run(receiver.receive(ticket_r, dst))  # one good transfer between two processes
        want = make_pool()
        fill(want, "r", 21, seed=5)
        assert_same_tokens(want, dst, "r")
        t0 = time.monotonic()
        with pytest.raises(TransferError) as info:
            run(receiver.receive(ticket_s, dst))
        assert info.value.reason is TransferFailure.LOST and info.value.retryable
        assert time.monotonic() - t0 < FAST.connect_timeout_s + FAST.transfer_timeout_s + 5.0
        assert dst.pages("r") and not dst.has("s") and dst.free_pages == dst.num_pages - len(dst.pages("r"))
        receiver.close()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()


def test_pool_exhausted_and_shape_mismatch_never_call_the_sender(pair):
    src = make_pool()
    fill(src, "r", 30)  # 4 pages
    ticket = pair.sender.export(src, "r")
    small = make_pool(num_pages=2)
    with pytest.raises(TransferError) as info:
        run(pair.receiver.receive(ticket, small))
    assert info.value.reason is TransferFailure.POOL_EXHAUSTED and info.value.retryable
    other = make_pool(head_dim=8)
    with pytest.raises(TransferError) as info:
        run(pair.receiver.receive(ticket, other))
    assert info.value.reason is TransferFailure.SHAPE and not info.value.retryable
    assert pair.calls == [] and small.free_pages == 2 and other.free_pages == other.num_pages


def test_bad_tickets_are_refused_before_any_page_is_taken(pair):
    src, dst = make_pool(), make_pool()
    fill(src, "r", 6)
    good = pair.sender.export(src, "r")
    header = KVFrameHeader.decode(good.handle["header"])
    cases = [
        ("not a ticket", TransferFailure.MALFORMED),
        (dataclasses.replace(good, transport="nccl"), TransferFailure.UNAVAILABLE),
        (dataclasses.replace(good, handle={"header": good.handle["header"]}), TransferFailure.MALFORMED),
        (dataclasses.replace(good, handle={**good.handle, "sender": {"host": "x"}}), TransferFailure.MALFORMED),
        (dataclasses.replace(good, handle={**good.handle, "header": b"\x80"}), TransferFailure.MALFORMED),
        (dataclasses.replace(good, handle={**good.handle, "header": dataclasses.replace(
            header, checksum_kind="crc32", checksum=1).encode()}), TransferFailure.MALFORMED),
        (dataclasses.replace(good, request_id="someone-else"), TransferFailure.REQUEST_MISMATCH),
    ]
    for ticket, reason in cases:
        with pytest.raises(TransferError) as info:
            run(pair.receiver.receive(ticket, dst))
        assert info.value.reason is reason, ticket
    lonely = ChannelReceiver("cpu", config=FAST)  # no call_sender: cannot reach anyone
    with pytest.raises(TransferError, match="call_sender") as info:
        run(lonely.receive(good, dst))
    assert info.value.reason is TransferFailure.UNAVAILABLE
    lonely.close()
    with pytest.raises(TransferError, match="closed") as info:
        closed = Pair()
        closed.close()
        run(closed.receiver.receive(good, dst))
    assert pair.calls == [] and dst.free_pages == dst.num_pages


def test_serve_send_refuses_bad_stale_and_misrouted_requests(pair):
    src, dst = make_pool(), make_pool()
    fill(src, "r", 6)
    pair.sender.export(src, "r")
    good = SendPages(request_id="r", sender_id="P", receiver_id="D", host="127.0.0.1", port=1,
                     prefix="fpkv/P/D/1/", generation=1, backend="gloo", timeout_s=1.0, layers_per_chunk=1)
    cases = [
        ([1, 2], TransferFailure.UNAVAILABLE, "bad send request: request: expected a SendPages"),
        (dataclasses.asdict(good), TransferFailure.UNAVAILABLE, "bad send request: request: expected a SendPages"),
        (replace(good, port=0), TransferFailure.UNAVAILABLE, "port"),
        (replace(good, generation=True), TransferFailure.UNAVAILABLE, "generation"),
        (replace(good, prefix="elsewhere/"), TransferFailure.UNAVAILABLE, "prefix"),
        (replace(good, timeout_s=0), TransferFailure.UNAVAILABLE, "timeout_s"),
        (replace(good, layers_per_chunk=0), TransferFailure.UNAVAILABLE, "layers_per_chunk"),
        (replace(good, layers_per_chunk=4), TransferFailure.UNAVAILABLE, "at most the 3 layers"),
        (replace(good, host=""), TransferFailure.UNAVAILABLE, "host"),
        (replace(good, backend="nccl"), TransferFailure.UNAVAILABLE, "sends over gloo"),
        (replace(good, sender_id="Q"), TransferFailure.UNAVAILABLE, "pages are on replica Q"),
        (replace(good, request_id="unknown"), TransferFailure.LOST, "no exported pages"),
    ]
    for request, reason, words in cases:
        reply = run(pair.sender.serve_send(request))
        assert reply.ok is False and reply.reason == reason.value and words in reply.message, request
    # a real channel at generation 2, then a late request for generation 1: stale
    fill(src, "s", 4)
    run(pair.receiver.receive(pair.sender.export(src, "s"), dst))  # generation 1
    pair.receiver._inbound["P"].mark_broken()
    run(pair.receiver.receive(pair.sender.export(src, "r"), dst))  # generation 2
    pair.sender.export(src, "s")
    late = replace(pair.calls[0], request_id="s")
    reply = run(pair.sender.serve_send(late))
    assert reply.ok is False and reply.reason == "unavailable" and "stale" in reply.message


@pytest.mark.parametrize("end", [ChannelSender, ChannelReceiver])
def test_construction_errors(end):
    with pytest.raises(ValueError, match="device"):
        end("meta")
    with pytest.raises(ValueError, match="device"):
        end("tpu:0")
    with pytest.raises(ValueError, match="config"):
        end("cpu", config={"connect_timeout_s": 1})
    with pytest.raises(ValueError, match="identity"):
        end("cpu", identity={"replica_id": ""})
    with pytest.raises(ValueError, match="host"):
        end("cpu", host="")
    for field in ("connect_timeout_s", "transfer_timeout_s", "min_bytes_per_s", "idle_reopen_s"):
        for bad in (0, -1.0, True, "1"):
            with pytest.raises(ValueError, match=field):
                ChannelConfig(**{field: bad})
    for field, bads in (("chunk_bytes", (0, -4096, True, 1.5, "1", 1 << 51)), ("ring_depth", (0, -1, 9, True, 2.0, None))):
        for bad in bads:
            with pytest.raises(ValueError, match=field):
                ChannelConfig(**{field: bad})
    assert ChannelConfig(chunk_bytes=1, ring_depth=1).ring_depth == 1 and ChannelConfig(ring_depth=8).ring_depth == 8
    kw = dict(prefix="fpkv/a/b/1/", generation=1, host="127.0.0.1", device=torch.device("cpu"), connect_timeout_s=1.0)
    with pytest.raises(ValueError, match="backend"):
        Channel("mpi", rank=0, store_addr=("127.0.0.1", 1), **kw)
    with pytest.raises(ValueError, match="rank"):
        Channel("gloo", rank=2, store_addr=("127.0.0.1", 1), **kw)
    with pytest.raises(ValueError, match="store_addr"):
        Channel("gloo", rank=0, store_addr=("127.0.0.1", "80"), **kw)
    broken = Channel("gloo", rank=0, store_addr=("127.0.0.1", 1), **kw)
    broken.mark_broken()
    with pytest.raises(ChannelBroken):
        broken.run(torch.zeros(4, dtype=torch.uint8), 1.0)


def test_each_end_is_built_alone_and_plays_only_its_role():
    """The pair is two classes: a decode replica builds a receiver with no sender anywhere, a
    prefill replica a sender; neither has the other's methods, and both report the full set
    of channel counters (a replica's stats keep one shape whichever end it holds)."""
    from kv_transfer.transfer import KVReceiver, KVSender, KVTransport

    receiver = ChannelReceiver("cpu", identity={"replica_id": "D"}, config=FAST)
    sender = ChannelSender("cpu", identity={"replica_id": "P"}, config=FAST)
    try:
        assert isinstance(receiver, KVReceiver) and not isinstance(receiver, (KVSender, KVTransport))
        assert isinstance(sender, KVSender) and not isinstance(sender, (KVReceiver, KVTransport))
        for method in ("export", "discard", "serve_send", "serve_send_blocking"):
            assert not hasattr(receiver, method), method
        for method in ("receive", "receive_heads", "call_sender"):
            assert not hasattr(sender, method), method
        assert receiver.name == sender.name == "gloo" and sender.serves_sends and sender.reads_pages_after_export
        assert not receiver.releases_after_receive
        keys = {"channel_sends", "channel_receives", "channel_failures", "channels_opened", "channel_bytes_sent",
                "channel_bytes_received", "channels_open", "channel_staged"}
        assert receiver.counters() == sender.counters() == dict.fromkeys(keys, 0)
    finally:
        receiver.close()
        sender.close()


def test_closing_a_sender_forgets_its_exports():
    sender = ChannelSender("cpu", identity={"replica_id": "P"}, config=FAST)
    src = make_pool()
    fill(src, "r", 7, seed=3)
    sender.export(src, "r")
    assert sender.counters()["channel_staged"] == 1
    sender.close()
    sender.close()  # idempotent
    assert sender.counters()["channel_staged"] == 0
    request = SendPages(request_id="r", sender_id="P", receiver_id="D", host="127.0.0.1", port=1,
                        prefix="fpkv/P/D/1/", generation=1, backend="gloo", timeout_s=1.0, layers_per_chunk=1)
    reply = run(sender.serve_send(request))
    assert reply.ok is False and reply.reason == TransferFailure.LOST.value and "no exported pages" in reply.message


def test_export_checks(pair):
    src = make_pool()
    fill(src, "r", 5)
    with pytest.raises(ValueError, match="fault"):
        pair.sender.export(src, "r", fault="truncate")
    with pytest.raises(KeyError):
        pair.sender.export(src, "nobody")
    ticket = pair.sender.export(src, "r")
    assert isinstance(ticket, TransferTicket) and ticket.nbytes == KVFrameHeader.decode(ticket.handle["header"]).payload_bytes


# ----------------------------------------------------------------------------- NCCL (2 GPUs)
TWO_GPUS = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                              reason="NCCL channel between cuda:0 and cuda:1 needs 2 GPUs")


def _cuda_pool(index: int, dtype: torch.dtype):
    from kv_cache import KVPool, KVPoolConfig

    return KVPool(KVPoolConfig(num_layers=3, num_kv_heads=2, head_dim=64, page_size=16, dtype=dtype, num_pages=64,
                               device=f"cuda:{index}"))


@TWO_GPUS
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("chunking", [{}, {"chunk_bytes": 1, "ring_depth": 2}], ids=["one-chunk", "per-layer"])
def test_nccl_channel_between_two_gpus(dtype, chunking):
    """per-layer: 3 chunks through 2 ring slots on each side (events, side streams, stream
    waits on the NCCL work); one-chunk: the whole request at once."""
    src, dst = _cuda_pool(0, dtype), _cuda_pool(1, dtype)
    # the first op builds the communicator
    cfg = ChannelConfig(connect_timeout_s=60.0, transfer_timeout_s=30.0, **chunking)
    sender = ChannelSender("cuda:0", identity={"replica_id": "P"}, config=cfg)
    receiver = ChannelReceiver("cuda:1", identity={"replica_id": "D"},
                               call_sender=lambda s, r: sender.serve_send(r), config=cfg)
    try:
        assert sender.name == receiver.name == "nccl"
        dst.reserve("other", 40)
        for i, n in enumerate((1, 100, 333)):
            rid = f"r{i}"
            fill(src, rid, n, seed=n)
            pages = run(receiver.receive(sender.export(src, rid), dst))
            assert pages == dst.pages(rid) and dst.seq_len(rid) == n
            assert torch.equal(gather_pages(src, src.pages(rid)).cpu(), gather_pages(dst, pages).cpu())
        fill(src, "bad", 50, seed=1)
        free = dst.free_pages
        with pytest.raises(TransferError, match="chunk 1 of 3" if chunking else "chunk 0 of 1") as info:
            run(receiver.receive(sender.export(src, "bad", fault="flip"), dst))
        assert info.value.reason is TransferFailure.CHECKSUM and not dst.has("bad") and dst.free_pages == free
        run(receiver.receive(sender.export(src, "bad"), dst))  # a new generation: a new communicator
        assert torch.equal(gather_pages(src, src.pages("bad")).cpu(), gather_pages(dst, dst.pages("bad")).cpu())
        assert receiver.counters()["channels_opened"] == 2 and sender.counters()["channel_sends"] == 5
    finally:
        sender.close()
        receiver.close()
