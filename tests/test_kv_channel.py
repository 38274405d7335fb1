"""Pairwise KV channels (kv_transfer.channel) over gloo on CPU: the code path NCCL runs on GPUs.

Sender and receiver are two ChannelTransports in this process (worker threads run each end
of the process group) and, for a peer that really dies, a sender in a child process. The
receiver reaches the sender through ``call_sender``, which the service implements as a Serve
call pinned to the prefill replica.
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing
import os
import time

import pytest
import torch

from kv_transfer.channel import (
    Channel,
    ChannelBroken,
    ChannelConfig,
    ChannelTransport,
    gather_pages,
    payload_checksum,
    scatter_pages,
)
from kv_transfer.transfer import KVFrameHeader, TransferError, TransferFailure, TransferTicket
from tests.test_kv_transfer import fill, make_pool, tokens_of

FAST = ChannelConfig(connect_timeout_s=2.0, transfer_timeout_s=1.0, idle_reopen_s=60.0)


class Pair:
    """A sender and a receiver transport; ``calls`` records what the receiver asked."""

    def __init__(self, config: ChannelConfig = FAST, call=None) -> None:
        self.sender = ChannelTransport("cpu", identity={"replica_id": "P"}, config=config)
        self.calls: list[dict] = []

        async def call_sender(sender: dict, request: dict) -> dict:
            self.calls.append(request)
            if call is not None:
                return await call(sender, request)
            return await self.sender.serve_send(request)

        self.receiver = ChannelTransport("cpu", identity={"replica_id": "D"}, call_sender=call_sender, config=config)

    def close(self) -> None:
        self.sender.close()
        self.receiver.close()


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
    assert pair.sender.counters()["channel_staged"] == 0  # staging copies go once sent
    assert [c["generation"] for c in pair.calls] == [1, 1, 1]


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
        assert [c["generation"] for c in p.calls] == [1, 2]
        assert p.sender.counters()["channels_open"] == 1 and p.receiver.counters()["channels_open"] == 1
        assert_same_tokens(src, dst, "b")
    finally:
        p.close()


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
    assert [c["generation"] for c in pair.calls] == [1, 2]
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
    quick = ChannelTransport("cpu", identity={"replica_id": "Q"}, config=cfg)
    silent = ChannelTransport("cpu", identity={"replica_id": "S"}, config=cfg)

    async def call_sender(sender, request):
        if sender["replica_id"] == "S":  # never joins: the receiver's rendezvous waits it out
            await asyncio.sleep(3600)
        return await quick.serve_send(request)

    receiver = ChannelTransport("cpu", identity={"replica_id": "D"}, call_sender=call_sender, config=cfg)
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
    sender = ChannelTransport("cpu", identity={"replica_id": "child"}, config=FAST)
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

        receiver = ChannelTransport("cpu", identity={"replica_id": "D"}, call_sender=call_sender, config=FAST)
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
    lonely = ChannelTransport("cpu", config=FAST)  # no call_sender: cannot reach anyone
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
    good = {"request_id": "r", "sender_id": "P", "receiver_id": "D", "host": "127.0.0.1", "port": 1,
            "prefix": "fpkv/P/D/1/", "generation": 1, "backend": "gloo", "timeout_s": 1.0,
            "layers_per_chunk": 1}
    cases = [
        ([1, 2], TransferFailure.UNAVAILABLE, "bad send request"),
        ({**good, "extra": 1}, TransferFailure.UNAVAILABLE, "bad send request"),
        ({**good, "port": 0}, TransferFailure.UNAVAILABLE, "port"),
        ({**good, "generation": True}, TransferFailure.UNAVAILABLE, "generation"),
        ({**good, "prefix": "elsewhere/"}, TransferFailure.UNAVAILABLE, "prefix"),
        ({**good, "timeout_s": 0}, TransferFailure.UNAVAILABLE, "timeout_s"),
        ({**good, "layers_per_chunk": 0}, TransferFailure.UNAVAILABLE, "layers_per_chunk"),
        ({**good, "layers_per_chunk": 4}, TransferFailure.UNAVAILABLE, "at most the 3 layers"),
        ({k: v for k, v in good.items() if k != "layers_per_chunk"}, TransferFailure.UNAVAILABLE, "bad send request"),
        ({**good, "host": ""}, TransferFailure.UNAVAILABLE, "host"),
        ({**good, "backend": "nccl"}, TransferFailure.UNAVAILABLE, "sends over gloo"),
        ({**good, "sender_id": "Q"}, TransferFailure.UNAVAILABLE, "pages are on replica Q"),
        ({**good, "request_id": "unknown"}, TransferFailure.LOST, "no exported pages"),
    ]
    for request, reason, words in cases:
        reply = run(pair.sender.serve_send(request))
        assert reply["ok"] is False and reply["reason"] == reason.value and words in reply["message"], request
    # a real channel at generation 2, then a late request for generation 1: stale
    fill(src, "s", 4)
    run(pair.receiver.receive(pair.sender.export(src, "s"), dst))  # generation 1
    pair.receiver._inbound["P"].mark_broken()
    run(pair.receiver.receive(pair.sender.export(src, "r"), dst))  # generation 2
    pair.sender.export(src, "s")
    late = {**pair.calls[0], "request_id": "s"}
    reply = run(pair.sender.serve_send(late))
    assert reply["ok"] is False and reply["reason"] == "unavailable" and "stale" in reply["message"]


def test_construction_errors():
    with pytest.raises(ValueError, match="device"):
        ChannelTransport("meta")
    with pytest.raises(ValueError, match="device"):
        ChannelTransport("tpu:0")
    with pytest.raises(ValueError, match="config"):
        ChannelTransport("cpu", config={"connect_timeout_s": 1})
    with pytest.raises(ValueError, match="identity"):
        ChannelTransport("cpu", identity={"replica_id": ""})
    with pytest.raises(ValueError, match="host"):
        ChannelTransport("cpu", host="")
    for field in ("connect_timeout_s", "transfer_timeout_s", "min_bytes_per_s", "idle_reopen_s"):
        for bad in (0, -1.0, True, "1"):
            with pytest.raises(ValueError, match=field):
                ChannelConfig(**{field: bad})
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
    from kv_transfer.pool import KVPool, KVPoolConfig

    return KVPool(KVPoolConfig(num_layers=3, num_kv_heads=2, head_dim=64, page_size=16, dtype=dtype, num_pages=64,
                               device=f"cuda:{index}"))


def _fill_on_device(pool, rid: str, n: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.reserve(rid, n)
    slots = pool.slot_mapping([rid], [0], [n])
    for layer in range(pool.num_layers):
        k = torch.randn(n, pool.num_kv_heads, pool.head_dim, generator=g).to(pool.device)
        v = torch.randn(n, pool.num_kv_heads, pool.head_dim, generator=g).to(pool.device)
        pool.write(layer, slots, k, v)
    pool.set_seq_len(rid, n)


@TWO_GPUS
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_nccl_channel_between_two_gpus(dtype):
    src, dst = _cuda_pool(0, dtype), _cuda_pool(1, dtype)
    cfg = ChannelConfig(connect_timeout_s=60.0, transfer_timeout_s=30.0)  # the first op builds the communicator
    sender = ChannelTransport("cuda:0", identity={"replica_id": "P"}, config=cfg)
    receiver = ChannelTransport("cuda:1", identity={"replica_id": "D"},
                                call_sender=lambda s, r: sender.serve_send(r), config=cfg)
    try:
        assert sender.name == receiver.name == "nccl"
        dst.reserve("other", 40)
        for i, n in enumerate((1, 100, 333)):
            rid = f"r{i}"
            _fill_on_device(src, rid, n, seed=n)
            pages = run(receiver.receive(sender.export(src, rid), dst))
            assert pages == dst.pages(rid) and dst.seq_len(rid) == n
            assert torch.equal(gather_pages(src, src.pages(rid)).cpu(), gather_pages(dst, pages).cpu())
        _fill_on_device(src, "bad", 50, seed=1)
        with pytest.raises(TransferError) as info:
            run(receiver.receive(sender.export(src, "bad", fault="flip"), dst))
        assert info.value.reason is TransferFailure.CHECKSUM and not dst.has("bad")
        run(receiver.receive(sender.export(src, "bad"), dst))  # a new generation: a new communicator
        assert torch.equal(gather_pages(src, src.pages("bad")).cpu(), gather_pages(dst, dst.pages("bad")).cpu())
        assert receiver.counters()["channels_opened"] == 2 and sender.counters()["channel_sends"] == 5
    finally:
        sender.close()
        receiver.close()
