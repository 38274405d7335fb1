"""Same-GPU KV transfers over CUDA IPC (kv_transfer.cuda_ipc).

CPU tests run everything but the two CUDA calls (``_share_cuda_`` / ``_new_shared_cuda``):
``FakeIpcSender`` shares a storage by registering it under a random handle and
``FakeIpcReceiver`` opens it by looking it up, so the ticket format, its validation, the page copy, the mapping cache, page
accounting on every failure and the routing to a fallback transport run as they do on a GPU.
The GPU tests (``@pytest.mark.gpu``) run the real IPC path between two processes on one GPU.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import os
import struct
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from kv_cache import KVPool, KVPoolConfig
from kv_cache.tensors import _plain_cuda_segments, copy_word
from kv_transfer.channel.recv import ChannelReceiver
from kv_transfer.channel.send import ChannelSender
from kv_transfer.channel.config import ChannelConfig
from kv_transfer.cuda_ipc.common import _process_alive, copy_pages, parse_ticket
from kv_transfer.cuda_ipc.recv import CudaIpcReceiver
from kv_transfer.cuda_ipc.send import CudaIpcSender
from kv_transfer.transfer import (
    FRAME_MAGIC,
    KVFrameHeader,
    KVReceiver,
    KVSender,
    KVTransport,
    TransferError,
    TransferFailure,
    TransferTicket,
    pack_pages,
    read_frame,
)
from kv_transfer.wire import StagePages, StageReply
from tests.test_kv_transfer import fill, make_pool, tokens_of

FAST = ChannelConfig(connect_timeout_s=2.0, transfer_timeout_s=1.0, idle_reopen_s=60.0)
_FAKE_HANDLES: dict[bytes, torch.Tensor] = {}


class FakeIpcSender(CudaIpcSender):
    """CudaIpcSender with the CUDA sharing call replaced by a registry (see the module
    docstring); ``gpu`` is the UUID its pools report."""

    def __init__(self, gpu: str = "GPU-A", **kw) -> None:
        super().__init__(uuid_of=lambda device: gpu, **kw)

    def _share_storage(self, tensor):
        storage = tensor.untyped_storage()
        base = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (storage.nbytes(),), (1,))
        handle = os.urandom(66)
        _FAKE_HANDLES[handle] = base
        part = {"handle": handle, "size": storage.nbytes(), "offset": 0, "ref_counter": b"/torch_fake",
                "ref_counter_offset": 0, "tensor_offset": tensor.storage_offset() * tensor.element_size()}
        return part, base


class FakeIpcReceiver(CudaIpcReceiver):
    """CudaIpcReceiver that opens what a ``FakeIpcSender`` registered; ``gpu`` is the UUID its
    pools report; ``opened`` counts storages opened."""

    def __init__(self, gpu: str = "GPU-A", **kw) -> None:
        super().__init__(uuid_of=lambda device: gpu, **kw)
        self.opened = 0
        self.on_open = None  # called with the storage part before it is returned

    def _open_storage(self, part, pid, device):
        self.opened += 1
        if self.on_open is not None:
            self.on_open(part)
        return _FAKE_HANDLES[part.handle]


class FakeTransport(KVTransport):
    """A fallback that records what it is asked to do."""

    name = "fake"

    def __init__(self) -> None:
        self.exports: list[str] = []
        self.received: list[TransferTicket] = []
        self.discarded: list[TransferTicket] = []
        self.closed = False
        self.export_error: Exception | None = None

    def export(self, pool, request_id, *, fault=None):
        if self.export_error is not None:
            raise self.export_error
        self.exports.append(request_id)
        n = pool.seq_len(request_id)
        return TransferTicket(request_id, self.name, n, pool.pages_for(n), 0, {"from": "fake"})

    async def receive(self, ticket, pool):
        self.received.append(ticket)
        return pool.adopt(ticket.request_id, ticket.num_tokens)

    def discard(self, ticket):
        self.discarded.append(ticket)

    def counters(self):
        return {"fake_transfers": len(self.received)}

    def close(self):
        self.closed = True


def run(coro):
    return asyncio.run(coro)


def same_bytes(src: KVPool, dst: KVPool, rid: str) -> bool:
    return all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(tokens_of(src, rid), tokens_of(dst, rid)))


def set_scales(*pools: KVPool) -> None:
    for pool in pools:
        for layer in range(pool.num_layers):
            pool.set_scales(layer, torch.tensor([0.5, 2.0]), torch.tensor([0.25, 4.0]))


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


# ----------------------------------------------------------------------------- transfers
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("page_size,chunk", [(1, 1), (8, 256 << 20), (16, 3000)])
def test_pages_arrive_bit_exact_from_a_fragmented_pool(dtype, page_size, chunk):
    src = make_pool(num_pages=64, page_size=page_size, dtype=dtype)
    dst = make_pool(num_pages=64, page_size=page_size, dtype=dtype)
    if dtype == torch.float8_e4m3fn:  # the header carries the scales; they must match
        set_scales(src, dst)
    fill(src, "a", 2 * page_size + 1, seed=1)
    fill(src, "hole", 3 * page_size, seed=2)
    fill(src, "b", page_size, seed=3)
    src.release("hole")  # the next request takes the hole's pages and fresh ones: not contiguous
    dst.reserve("other", 5 * page_size)  # the receiver's page ids differ from the sender's
    sender = FakeIpcSender(identity={"replica_id": "P"})
    receiver = FakeIpcReceiver(identity={"replica_id": "D"}, copy_chunk_bytes=chunk)
    try:
        for i, n in enumerate((1, 4 * page_size + 3, 9 * page_size)):
            rid = f"r{i}"
            fill(src, rid, n, seed=100 + n)
            ticket = sender.export(src, rid)
            assert ticket.transport == "cuda_ipc" and ticket.num_tokens == n and ticket.num_pages == -(-n // page_size)
            pages = run(receiver.receive(ticket, dst))
            assert pages == dst.pages(rid) and dst.seq_len(rid) == n and src.has(rid)  # the sender keeps its pages
            assert same_bytes(src, dst, rid)
        assert any(b - a != 1 for a, b in zip(src.pages("r1"), src.pages("r1")[1:]))  # it was fragmented
        stats = receiver.counters()
        assert stats["ipc_receives"] == 3 and stats["ipc_failures"] == 0
        assert stats["ipc_bytes_received"] == src.page_bytes * sum(-(-n // page_size)
                                                                   for n in (1, 4 * page_size + 3, 9 * page_size))
        assert receiver.opened == 2 == stats["ipc_mappings_open"]  # K and V, opened once, reused
        assert sender.counters()["ipc_exports"] == 3 and sender.counters()["ipc_exported"] == 3
    finally:
        sender.close()
        receiver.close()


def test_sender_pool_at_an_odd_offset_of_its_storage():
    """The tensor need not start its storage: bf16 two bytes in, so the copy uses 2-byte words."""
    src, dst = make_pool(dtype=torch.bfloat16), make_pool(dtype=torch.bfloat16)
    for name in ("k", "v"):
        t = getattr(src, name)
        big = torch.zeros(t.numel() + 1, dtype=t.dtype)
        setattr(src, name, big[1:].view(t.shape))
        setattr(src, name + "_raw", getattr(src, name))  # bf16: the storage is the logical tensor
    fill(src, "r", 21, seed=4)
    sender, receiver = FakeIpcSender(), FakeIpcReceiver()
    ticket = sender.export(src, "r")
    assert ticket.handle["k"]["tensor_offset"] == 2
    run(receiver.receive(ticket, dst))
    assert same_bytes(src, dst, "r")


def test_empty_request_takes_no_page_and_opens_nothing():
    src, dst = make_pool(), make_pool()
    src.reserve("e", 0)
    receiver = FakeIpcReceiver()
    assert run(receiver.receive(FakeIpcSender().export(src, "e"), dst)) == [] and dst.has("e")
    assert receiver.opened == 0


@pytest.mark.parametrize("row_bytes,offset,word", [(256, 0, torch.int64), (12, 0, torch.int32), (6, 0, torch.int16),
                                                   (3, 0, torch.uint8), (256, 4, torch.int32), (256, 2, torch.int16)])
def test_word_is_the_widest_dividing_row_and_offset(row_bytes, offset, word):
    assert copy_word(row_bytes, offset) is word


def test_copy_pages_in_chunks_matches_a_plain_loop():
    g = torch.Generator().manual_seed(7)
    src = torch.randint(-2**62, 2**62, (4, 30, 3, 2, 5), generator=g)
    src_pages = torch.randperm(30, generator=g)[:11]
    dst_pages = torch.randperm(20, generator=g)[:11]
    page_bytes = 3 * 2 * 5 * 8
    for chunk in (1, page_bytes * 3, page_bytes * 11 * 2, 1 << 30):
        dst = torch.randint(-2**62, 2**62, (4, 20, 3, 2, 5), generator=g)
        want = dst.clone()
        for s, d in zip(src_pages.tolist(), dst_pages.tolist()):
            want[:, d] = src[:, s]
        copy_pages(src, dst, src_pages, dst_pages, chunk)
        assert torch.equal(dst, want), chunk
    with pytest.raises(ValueError, match="src"):
        copy_pages(src[:, :, :2], dst, src_pages, dst_pages, 1)
    with pytest.raises(ValueError, match="src"):
        copy_pages(src.to(torch.int32), dst, src_pages, dst_pages, 1)
    with pytest.raises(ValueError, match="src_pages"):
        copy_pages(src, dst, src_pages[:3], dst_pages, 1)
    for bad in (0, True, 1.5):
        with pytest.raises(ValueError, match="chunk_bytes"):
            copy_pages(src, dst, src_pages, dst_pages, bad)


# ----------------------------------------------------------------------------- refusals
def _good_ticket():
    src = make_pool()
    fill(src, "r", 13, seed=9)
    sender = FakeIpcSender(identity={"replica_id": "P", "app": "a", "deployment": "d"}, lease_timeout_s=60.0)
    return src, sender, sender.export(src, "r")


def test_bad_tickets_are_refused_before_any_page_is_taken():
    src, _, good = _good_ticket()
    dst = make_pool()
    header = KVFrameHeader.decode(good.handle["header"])
    h = good.handle

    def with_handle(**changes):
        return dataclasses.replace(good, handle={**h, **changes})

    def with_part(part, **changes):
        return with_handle(**{part: {**h[part], **changes}})

    malformed = [
        "not a ticket",
        dataclasses.replace(good, handle=[1, 2]),
        dataclasses.replace(good, handle={k: v for k, v in h.items() if k != "pidns"}),
        with_handle(extra=1),
        with_handle(header="text"),
        with_handle(header=b"\x80"),
        with_handle(header=dataclasses.replace(header, checksum_kind="crc32", checksum=1).encode()),
        with_handle(sender={"app": "a"}),
        with_handle(sender={"replica_id": ""}),
        with_handle(sender={"replica_id": "P", "n": 3}),
        with_handle(device_uuid=""),
        with_handle(device_uuid=7),
        with_handle(pid=0),
        with_handle(pid=True),
        with_handle(pidns=5),
        with_handle(pool_pages=0),
        with_handle(pages=h["pages"][:-1]),
        with_handle(pages=[*h["pages"][:-1], src.num_pages]),
        with_handle(pages=[*h["pages"][:-1], -1]),
        with_handle(pages=[*h["pages"][:-1], True]),
        with_handle(pages=tuple(h["pages"])),
        with_handle(pool_pages=10 ** 6),  # a pool that size does not fit the storage
        with_handle(fallback=3),
        with_handle(expires_at=float("nan")),
        with_handle(expires_at=-1.0),
        with_handle(expires_at="soon"),
        with_handle(k="handle"),
        with_handle(k={**h["k"], "extra": 0}),
        with_part("v", handle=b""),
        with_part("v", handle="abc"),
        with_part("k", handle=b"x" * 5000),
        with_part("k", size=0),
        with_part("k", offset=-1),
        with_part("k", offset=2 ** 70),
        with_part("k", ref_counter=None),
        with_part("k", ref_counter_offset=1.0),
        with_part("k", tensor_offset=h["k"]["size"]),  # the pool would end past the storage
    ]
    receiver = FakeIpcReceiver()
    for ticket in malformed:
        with pytest.raises(TransferError) as info:
            run(receiver.receive(ticket, dst))
        assert info.value.reason is TransferFailure.MALFORMED and not info.value.retryable, ticket
    with pytest.raises(TransferError) as info:
        run(receiver.receive(dataclasses.replace(good, transport="nccl"), dst))
    assert info.value.reason is TransferFailure.UNAVAILABLE
    with pytest.raises(TransferError) as info:
        run(receiver.receive(dataclasses.replace(good, request_id="someone-else"), dst))
    assert info.value.reason is TransferFailure.REQUEST_MISMATCH
    assert dst.free_pages == dst.num_pages and receiver.opened == 0 and receiver.counters()["ipc_receives"] == 0
    assert parse_ticket(good).pages == src.pages("r")  # the good one parses


def test_another_gpu_without_a_fallback_is_unavailable():
    src, sender, ticket = _good_ticket()
    dst = make_pool()
    for receiver in (FakeIpcReceiver(gpu="GPU-B"), CudaIpcReceiver()):  # another GPU; a CPU pool (no UUID)
        with pytest.raises(TransferError, match="GPU-A") as info:
            run(receiver.receive(ticket, dst))
        assert info.value.reason is TransferFailure.UNAVAILABLE and info.value.retryable
        assert receiver.counters()["ipc_failures"] == 1
    # a receiver with a fallback the sender does not offer cannot use it either
    fallback = FakeTransport()
    receiver = FakeIpcReceiver(gpu="GPU-B", fallback=fallback, call_sender=lambda s, r: None)
    with pytest.raises(TransferError, match="offers") as info:
        run(receiver.receive(dataclasses.replace(ticket, handle={**ticket.handle, "fallback": "nccl"}), dst))
    assert info.value.reason is TransferFailure.UNAVAILABLE and fallback.received == []
    assert dst.free_pages == dst.num_pages


def test_break_fault_names_no_gpu_and_offers_no_fallback():
    src = make_pool()
    fill(src, "r", 9)
    fallback = FakeTransport()
    sender = FakeIpcSender(fallback=FakeTransport())
    ticket = sender.export(src, "r", fault="break")
    receiver = FakeIpcReceiver(fallback=fallback, call_sender=lambda s, r: None)  # same GPU as the sender
    dst = make_pool()
    with pytest.raises(TransferError) as info:
        run(receiver.receive(ticket, dst))
    assert info.value.reason is TransferFailure.UNAVAILABLE and info.value.retryable
    assert fallback.received == [] and receiver.opened == 0 and dst.free_pages == dst.num_pages
    run(receiver.receive(sender.export(src, "r"), dst))  # the next export is intact
    assert same_bytes(src, dst, "r")


def test_pool_exhausted_and_shape_mismatch_open_nothing():
    _, _, ticket = _good_ticket()
    receiver = FakeIpcReceiver()
    small = make_pool(num_pages=1)
    with pytest.raises(TransferError) as info:
        run(receiver.receive(ticket, small))
    assert info.value.reason is TransferFailure.POOL_EXHAUSTED and info.value.retryable
    for other in (make_pool(head_dim=8), make_pool(dtype=torch.bfloat16), make_pool(page_size=4)):
        with pytest.raises(TransferError) as info:
            run(receiver.receive(ticket, other))
        assert info.value.reason is TransferFailure.SHAPE and not info.value.retryable
        assert other.free_pages == other.num_pages
    assert small.free_pages == 1 and receiver.opened == 0


def test_open_and_copy_failures_release_the_pages(monkeypatch):
    src, _, ticket = _good_ticket()
    dst = make_pool()
    receiver = FakeIpcReceiver()

    def refuse(part):
        raise TransferError(TransferFailure.UNAVAILABLE, "cannot open the sender's CUDA IPC handle: gone")

    receiver.on_open = refuse
    with pytest.raises(TransferError, match="gone") as info:
        run(receiver.receive(ticket, dst))
    assert info.value.reason is TransferFailure.UNAVAILABLE and info.value.request_id == "r"
    assert dst.free_pages == dst.num_pages and receiver.counters()["ipc_mappings_open"] == 0
    receiver.on_open = None

    def broken_copy(*args):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr("kv_transfer.cuda_ipc.recv.copy_pages", broken_copy)
    with pytest.raises(TransferError, match="illegal memory access") as info:
        run(receiver.receive(ticket, dst))
    assert info.value.reason is TransferFailure.LOST and info.value.retryable
    assert dst.free_pages == dst.num_pages and not dst.has("r")
    assert receiver.device_error is None  # a CPU pool: no CUDA context to break
    monkeypatch.undo()
    run(receiver.receive(ticket, dst))  # the mapping is still good
    assert same_bytes(src, dst, "r") and receiver.counters()["ipc_failures"] == 2


def test_opened_storage_of_the_wrong_size_is_refused():
    _, _, ticket = _good_ticket()
    dst = make_pool()

    class Short(FakeIpcReceiver):
        def _open_storage(self, part, pid, device):
            return super()._open_storage(part, pid, device)[:-1]

    receiver = Short()
    with pytest.raises(TransferError, match="expected") as info:
        run(receiver.receive(ticket, dst))
    assert info.value.reason is TransferFailure.UNAVAILABLE and dst.free_pages == dst.num_pages


def test_an_expired_lease_is_refused_before_and_after_the_copy():
    src = make_pool()
    fill(src, "r", 13, seed=9)
    dst = make_pool()
    sender = FakeIpcSender(lease_timeout_s=0.3)
    ticket = sender.export(src, "r")
    assert 0.2 < ticket.handle["expires_at"] - time.time() <= 0.3
    receiver = FakeIpcReceiver()
    receiver.on_open = lambda part: time.sleep(0.4)  # the lease ends while the copy runs
    with pytest.raises(TransferError, match="lease expired during the copy") as info:
        run(receiver.receive(ticket, dst))
    assert info.value.reason is TransferFailure.LOST and dst.free_pages == dst.num_pages
    receiver.on_open = None
    with pytest.raises(TransferError, match="lease has expired") as info:
        run(receiver.receive(ticket, dst))
    assert info.value.reason is TransferFailure.LOST and dst.free_pages == dst.num_pages
    no_lease = FakeIpcSender().export(src, "r")  # lease_timeout_s None: no deadline in the ticket
    assert no_lease.handle["expires_at"] is None
    run(receiver.receive(no_lease, dst))


def test_a_sender_process_that_is_gone_fails_the_copy_and_its_mappings_close():
    src, _, ticket = _good_ticket()
    dst = make_pool()
    receiver = FakeIpcReceiver(identity={"replica_id": "D"})
    run(receiver.receive(ticket, dst))
    assert receiver.sweep() == 0 and receiver.counters()["ipc_mappings_open"] == 2  # alive, just used
    dst.release("r")
    gone = dataclasses.replace(ticket, handle={**ticket.handle, "pid": dead_pid()})
    with pytest.raises(TransferError, match="exited") as info:
        run(receiver.receive(gone, dst))
    assert info.value.reason is TransferFailure.LOST and dst.free_pages == dst.num_pages
    assert receiver.sweep() == 0  # the mapping is keyed by sender replica: still the live one's
    stats = receiver.counters()
    assert stats["ipc_mappings_open"] == 2 and stats["ipc_mappings_closed"] == 0
    # a sender replica whose process died: its mappings go at the next sweep
    dead = dataclasses.replace(gone, handle={**gone.handle, "sender": {"replica_id": "P2"}})
    with pytest.raises(TransferError):
        run(receiver.receive(dead, dst))
    assert receiver.counters()["ipc_mappings_open"] == 4 and receiver.sweep() == 2
    assert receiver.counters()["ipc_mappings_open"] == 2 and receiver.counters()["ipc_mappings_closed"] == 2


def test_idle_mappings_close_and_reopen():
    src, _, ticket = _good_ticket()
    dst = make_pool()
    receiver = FakeIpcReceiver(idle_close_s=0.05)
    run(receiver.receive(ticket, dst))
    time.sleep(0.1)
    assert receiver.sweep() == 2 and receiver.counters()["ipc_mappings_open"] == 0
    dst.release("r")
    run(receiver.receive(ticket, dst))  # opened again
    assert receiver.opened == 4 and same_bytes(src, dst, "r")


def test_process_alive():
    ns = os.readlink("/proc/self/ns/pid")
    assert _process_alive(os.getpid(), ns) is True
    assert _process_alive(dead_pid(), ns) is False
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while _process_alive(zombie.pid, ns) and time.monotonic() < deadline:  # exited, not reaped
        time.sleep(0.01)
    assert os.path.exists(f"/proc/{zombie.pid}") and _process_alive(zombie.pid, ns) is False
    zombie.wait()
    assert _process_alive(os.getpid(), "pid:[1]") is None and _process_alive(os.getpid(), None) is None


def test_cancelled_receive_frees_its_pages_only_after_the_copy():
    src, _, ticket = _good_ticket()
    dst = make_pool()
    receiver = FakeIpcReceiver()
    started, release = threading.Event(), threading.Event()

    def slow_open(part):
        started.set()
        release.wait(5)

    receiver.on_open = slow_open

    async def scenario():
        task = asyncio.ensure_future(receiver.receive(ticket, dst))
        while not started.is_set():
            await asyncio.sleep(0.01)
        task.cancel()
        await asyncio.sleep(0.1)
        held = (task.done(), dst.has("r"))  # still copying: the pages stay reserved
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task
        return held

    assert run(scenario()) == (False, True)
    assert dst.free_pages == dst.num_pages and not dst.has("r")


def test_closed_transport_refuses():
    src, sender, ticket = _good_ticket()
    receiver = FakeIpcReceiver()
    fallback = FakeTransport()
    holder = FakeIpcReceiver(fallback=fallback)
    run(receiver.receive(ticket, make_pool()))
    assert receiver.counters()["ipc_mappings_open"] == 2
    for t in (receiver, holder, sender):
        t.close()
        t.close()  # idempotent
    assert receiver.counters()["ipc_mappings_open"] == 0 and fallback.closed
    dst = make_pool()
    with pytest.raises(TransferError, match="closed") as info:
        run(receiver.receive(ticket, dst))
    assert info.value.reason is TransferFailure.UNAVAILABLE and dst.free_pages == dst.num_pages
    with pytest.raises(TransferError, match="closed"):
        sender.export(src, "r")


# ----------------------------------------------------------------------------- the fallback
def test_another_gpu_gets_the_pages_over_a_real_gloo_channel():
    src, dst = make_pool(), make_pool()
    dst.reserve("other", 10)
    fill(src, "r", 21, seed=12)
    send_ch = ChannelSender("cpu", identity={"replica_id": "P"}, config=FAST)
    recv_ch = ChannelReceiver("cpu", identity={"replica_id": "D"}, config=FAST,
                              call_sender=lambda s, r: send_ch.serve_send(r))
    sender = FakeIpcSender(gpu="GPU-A", identity={"replica_id": "P"}, fallback=send_ch)
    stage_calls = []

    async def stage(who, request):
        stage_calls.append((who, request))
        return await asyncio.to_thread(sender.serve_stage, src, request)

    receiver = FakeIpcReceiver(gpu="GPU-B", identity={"replica_id": "D"}, fallback=recv_ch, call_sender=stage)
    try:
        ticket = sender.export(src, "r")
        assert ticket.handle["fallback"] == "gloo" and send_ch.counters()["channel_staged"] == 0  # lazy
        pages = run(receiver.receive(ticket, dst))
        assert pages == dst.pages("r") and same_bytes(src, dst, "r")
        assert stage_calls == [({"replica_id": "P"}, StagePages(request_id="r", sender_id="P", transport="gloo"))]
        rstats, sstats = receiver.counters(), sender.counters()
        assert rstats["ipc_fallbacks"] == 1 and rstats["channel_receives"] == 1 and receiver.opened == 0
        assert sstats["ipc_stages"] == 1 and sstats["channel_sends"] == 1
        sender.discard(ticket)
        assert sender.counters()["ipc_exported"] == 0 and sender.counters()["channel_staged"] == 0
        # a receiver on the sender's GPU maps the pool and never asks for a staging
        same = FakeIpcReceiver(gpu="GPU-A", fallback=FakeTransport(), call_sender=stage)
        fill(src, "s", 7, seed=13)
        run(same.receive(sender.export(src, "s"), dst))
        assert same_bytes(src, dst, "s") and len(stage_calls) == 1 and same.fallback.received == []
        same.close()
    finally:
        sender.close()
        receiver.close()
    assert send_ch.counters()["channels_open"] == 0  # closed with the transport that owned it


@pytest.mark.parametrize("reply,reason", [
    (StageReply(False, "unavailable", "misrouted"), TransferFailure.UNAVAILABLE),
    (StageReply(False, "lost", "lease ended"), TransferFailure.LOST),
    (StageReply(False, "shape", "?"), TransferFailure.LOST),
    (StageReply(False, "bogus", "?"), TransferFailure.LOST),
    ("junk", TransferFailure.LOST),
    ({"ok": True, "ticket": TransferTicket("r", "fake", 1, 1, 0)}, TransferFailure.LOST),  # not a StageReply
    (StageReply("yes"), TransferFailure.LOST),
    (StageReply(True, ticket="not a ticket"), TransferFailure.LOST),
    (StageReply(True, ticket=TransferTicket("someone-else", "fake", 1, 1, 0)), TransferFailure.LOST),
    (StageReply(True, ticket=TransferTicket("r", "gloo", 1, 1, 0)), TransferFailure.LOST),
])
def test_bad_stage_replies_fail_without_taking_pages(reply, reason):
    _, _, ticket = _good_ticket()
    ticket = dataclasses.replace(ticket, handle={**ticket.handle, "fallback": "fake"})
    fallback = FakeTransport()

    async def call(who, request):
        return reply

    receiver = FakeIpcReceiver(gpu="GPU-B", fallback=fallback, call_sender=call)
    dst = make_pool()
    with pytest.raises(TransferError) as info:
        run(receiver.receive(ticket, dst))
    assert info.value.reason is reason and info.value.retryable
    assert fallback.received == [] and dst.free_pages == dst.num_pages
    assert receiver.counters()["ipc_failures"] == 1


def test_unreachable_or_slow_sender_fails_the_stage_as_lost():
    _, _, ticket = _good_ticket()
    ticket = dataclasses.replace(ticket, handle={**ticket.handle, "fallback": "fake"})

    async def gone(who, request):
        raise ConnectionError("replica died")

    async def slow(who, request):
        await asyncio.sleep(5)

    dst = make_pool()
    for call, words in ((gone, "ConnectionError"), (slow, "within")):
        receiver = FakeIpcReceiver(gpu="GPU-B", fallback=FakeTransport(), call_sender=call, stage_timeout_s=0.1)
        t0 = time.monotonic()
        with pytest.raises(TransferError, match=words) as info:
            run(receiver.receive(ticket, dst))
        assert info.value.reason is TransferFailure.LOST and time.monotonic() - t0 < 2.0
        assert dst.free_pages == dst.num_pages


def test_serve_stage_refuses_bad_misrouted_and_ended_requests():
    src = make_pool()
    fill(src, "r", 6)
    fallback = FakeTransport()
    sender = FakeIpcSender(identity={"replica_id": "P"}, fallback=fallback)
    ticket = sender.export(src, "r")
    good = StagePages(request_id="r", sender_id="P", transport="fake")
    cases = [
        ([1, 2], TransferFailure.UNAVAILABLE, "bad stage request: request: expected a StagePages"),
        (dataclasses.asdict(good), TransferFailure.UNAVAILABLE, "bad stage request: request: expected a StagePages"),
        (dataclasses.replace(good, request_id=""), TransferFailure.UNAVAILABLE, "request_id"),
        (dataclasses.replace(good, sender_id=7), TransferFailure.UNAVAILABLE, "sender_id"),
        (dataclasses.replace(good, transport="gloo"), TransferFailure.UNAVAILABLE, "stages over 'fake'"),
        (dataclasses.replace(good, sender_id="Q"), TransferFailure.UNAVAILABLE, "pages are on replica Q"),
        (dataclasses.replace(good, request_id="unknown"), TransferFailure.LOST, "lease ended"),
    ]
    for request, reason, words in cases:
        reply = sender.serve_stage(src, request)
        assert reply.ok is False and reply.reason == reason.value and words in reply.message, request
    assert FakeIpcSender().serve_stage(src, good).reason == "unavailable"  # no fallback at all
    for error, reason in ((TransferError(TransferFailure.SHAPE, "odd"), TransferFailure.LOST),
                          (TransferError(TransferFailure.UNAVAILABLE, "closed"), TransferFailure.UNAVAILABLE),
                          (RuntimeError("CUDA OOM"), TransferFailure.LOST)):
        fallback.export_error = error
        reply = sender.serve_stage(src, good)
        assert reply.ok is False and reply.reason == reason.value, error
    fallback.export_error = None
    reply = sender.serve_stage(src, good)
    assert reply.ok and reply.ticket.transport == "fake" and fallback.exports == ["r"]
    sender.discard(ticket)  # the lease ends: the staging goes with it, and no new one starts
    assert fallback.discarded == [reply.ticket]
    reply = sender.serve_stage(src, good)
    assert reply.ok is False and reply.reason == "lost"


def test_discard_waits_for_a_staging_in_progress():
    src = make_pool()
    fill(src, "r", 6)
    entered, go = threading.Event(), threading.Event()

    class Slow(FakeTransport):
        def export(self, pool, request_id, *, fault=None):
            entered.set()
            go.wait(5)
            return super().export(pool, request_id)

    fallback = Slow()
    sender = FakeIpcSender(identity={"replica_id": "P"}, fallback=fallback)
    ticket = sender.export(src, "r")
    replies: list = []
    stager = threading.Thread(target=lambda: replies.append(
        sender.serve_stage(src, StagePages(request_id="r", sender_id="P", transport="fake"))))
    stager.start()
    assert entered.wait(5)
    discarder = threading.Thread(target=sender.discard, args=(ticket,))
    discarder.start()
    discarder.join(0.2)
    assert discarder.is_alive()  # the caller would free the pages next: not while they are read
    go.set()
    stager.join(5)
    discarder.join(5)
    assert not discarder.is_alive() and replies[0].ok and fallback.discarded == [replies[0].ticket]


# ----------------------------------------------------------------------------- construction, export
class OnlySends(KVSender):
    name = "only-sends"

    def export(self, pool, request_id, *, fault=None): ...


class OnlyReceives(KVReceiver):
    name = "only-receives"

    async def receive(self, ticket, pool): ...


def test_construction_errors():
    both = [
        (dict(identity={"replica_id": ""}), "identity"),
        (dict(identity={"replica_id": 3}), "identity"),
        (dict(fallback="nccl"), "fallback"),
        (dict(uuid_of="GPU-A"), "uuid_of"),
    ]
    sender = [
        (dict(fallback=CudaIpcSender()), "fallback"),  # not another transport
        (dict(fallback=OnlyReceives()), "fallback"),  # a sender stages over a sender
        (dict(lease_timeout_s=0), "lease_timeout_s"),
        (dict(lease_timeout_s=True), "lease_timeout_s"),
        (dict(lease_timeout_s=math.inf), "lease_timeout_s"),
    ]
    receiver = [
        (dict(fallback=CudaIpcReceiver()), "fallback"),
        (dict(fallback=OnlySends()), "fallback"),  # a receiver receives over a receiver
        (dict(call_sender=5), "call_sender"),
        (dict(idle_close_s=-1.0), "idle_close_s"),
        (dict(idle_close_s=math.inf), "idle_close_s"),
        (dict(stage_timeout_s="1"), "stage_timeout_s"),
        (dict(stage_timeout_s=None), "stage_timeout_s"),
        (dict(copy_chunk_bytes=0), "copy_chunk_bytes"),
        (dict(copy_chunk_bytes=1.0), "copy_chunk_bytes"),
        (dict(max_workers=0), "max_workers"),
    ]
    for end, cases in ((CudaIpcSender, both + sender), (CudaIpcReceiver, both + receiver)):
        for kwargs, arg in cases:
            with pytest.raises(ValueError, match=arg):
                end(**kwargs)
    # each end takes the matching end of another transport, and keeps to its role
    ends = CudaIpcSender(fallback=OnlySends()), CudaIpcReceiver(fallback=OnlyReceives())
    assert isinstance(ends[0], KVSender) and not isinstance(ends[0], (KVReceiver, KVTransport))
    assert isinstance(ends[1], KVReceiver) and not isinstance(ends[1], (KVSender, KVTransport))
    assert not hasattr(ends[0], "receive") and not hasattr(ends[1], "export") and not hasattr(ends[1], "serve_stage")
    assert set(ends[0].counters()) == set(ends[1].counters())  # one shape of stats whichever end
    for end in ends:
        end.close()


def test_export_checks():
    src = make_pool()
    fill(src, "r", 5)
    sender = FakeIpcSender()
    with pytest.raises(ValueError, match="fault"):
        sender.export(src, "r", fault="flip")
    with pytest.raises(KeyError):
        sender.export(src, "nobody")
    with pytest.raises(TransferError, match="CUDA") as info:  # the real sharing: CUDA pools only
        CudaIpcSender().export(src, "r")
    assert info.value.reason is TransferFailure.UNAVAILABLE

    class NoHandle(FakeIpcSender):
        def __init__(self):
            super().__init__(gpu="")

    with pytest.raises(TransferError, match="CUDA"):
        NoHandle().export(src, "r")
    ticket = sender.export(src, "r")
    header = KVFrameHeader.decode(ticket.handle["header"])
    assert header.checksum_kind == "none" and header.checksum == 0 and ticket.nbytes == header.payload_bytes
    assert ticket.handle["pid"] == os.getpid() and ticket.handle["device_uuid"] == "GPU-A"
    again = sender.export(src, "r")  # the pool is shared once: the same handles
    assert again.handle["k"] == ticket.handle["k"] and again.handle["v"] == ticket.handle["v"]


def test_checksum_kind_none():
    src = make_pool()
    fill(src, "r", 5)
    header = KVFrameHeader.decode(FakeIpcSender().export(src, "r").handle["header"])
    assert KVFrameHeader.decode(header.encode()) == header
    with pytest.raises(TransferError, match="checksum") as info:
        KVFrameHeader.decode(dataclasses.replace(header, checksum=5).encode())
    assert info.value.reason is TransferFailure.MALFORMED
    # frames still carry a CRC-32: a frame whose header says "none" is refused
    good, payload = read_frame(pack_pages(src, "r"))
    raw = dataclasses.replace(good, checksum_kind="none", checksum=0).encode()
    bad = FRAME_MAGIC + struct.pack(">I", len(raw)) + raw + bytes(payload)
    with pytest.raises(TransferError, match="CRC-32") as info:
        read_frame(np.frombuffer(bad, dtype=np.uint8))
    assert info.value.reason is TransferFailure.MALFORMED


def test_cuda_pools_are_allocated_outside_expandable_segments(monkeypatch):
    calls: list = []
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append, raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:512,expandable_segments:True")
    with _plain_cuda_segments(torch.device("cpu")):
        pass
    assert calls == []
    with _plain_cuda_segments(torch.device("cuda", 0)):
        calls.append("allocate")
    assert calls == ["max_split_size_mb:512,expandable_segments:False", "allocate",
                     "max_split_size_mb:512,expandable_segments:True"]
    calls.clear()
    with pytest.raises(RuntimeError, match="OOM"):  # restored even when the allocation fails
        with _plain_cuda_segments(torch.device("cuda", 0)):
            raise RuntimeError("OOM")
    assert calls[-1] == "max_split_size_mb:512,expandable_segments:True"

    def refuse(conf):
        raise RuntimeError("unknown option")

    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse)
    with _plain_cuda_segments(torch.device("cuda", 0)):  # allocates as configured
        pass
    calls.clear()
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", calls.append)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    monkeypatch.setenv("PYTORCH_ALLOC_CONF", "expandable_segments: True")
    with _plain_cuda_segments(torch.device("cuda", 0)):
        pass
    assert calls == ["expandable_segments:False", "expandable_segments: True"]
    calls.clear()
    monkeypatch.delenv("PYTORCH_ALLOC_CONF")
    with _plain_cuda_segments(torch.device("cuda", 0)):
        pass
    assert calls == []


# ----------------------------------------------------------------------------- GPU: real CUDA IPC
GPU_CONFIGS = [  # (dtype, page_size): a pool per config in the sender process
    (torch.bfloat16, 1), (torch.bfloat16, 16), (torch.bfloat16, 64),
    (torch.float8_e4m3fn, 16), (torch.float8_e4m3fn, 64),
]
GPU_LENGTHS = (1, 37, 300)


def _gpu_pool(dtype: torch.dtype, page_size: int, num_pages: int = 48) -> KVPool:
    return KVPool(KVPoolConfig(num_layers=3, num_kv_heads=2, head_dim=128, page_size=page_size, dtype=dtype,
                               num_pages=num_pages, device="cuda:0"))


def _host_tokens(pool: KVPool, rid: str) -> list[np.ndarray]:
    """The request's K and V tokens as host bytes, read by plain indexing (not the code under test)."""
    return [t.view(torch.uint8).cpu().numpy() for t in tokens_of(pool, rid)]


def _same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) == 2 and all(np.array_equal(x, y) for x, y in zip(a, b))


def _gpu_sender(conn, alloc_conf: str) -> None:
    """Child process: the prefill side. Pools for every config, fragmented, one ticket per
    (config, length) with the expected bytes; stays alive until told, then sends its counters.
    Sends ``("error", text)`` instead if anything fails."""
    try:
        if alloc_conf:  # as bench_service sets it: the env (which the pool reads) and the allocator
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = alloc_conf
            setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None) \
                or torch.cuda.memory._set_allocator_settings
            setter(alloc_conf)
            torch.empty(8 << 20, dtype=torch.uint8, device="cuda:0")  # freed, its segment stays cached
            if not any(seg.get("is_expandable") for seg in torch.cuda.memory_snapshot()):
                raise AssertionError("expandable segments did not take effect: the test would prove nothing")
        pools = {}
        sender = CudaIpcSender(identity={"replica_id": "P"}, lease_timeout_s=120.0)
        out = []
        for dtype, page_size in GPU_CONFIGS:
            pool = pools[(dtype, page_size)] = _gpu_pool(dtype, page_size)
            fill(pool, "hole", 3 * page_size, seed=1)
            fill(pool, "keep", page_size, seed=2)
            pool.release("hole")  # later requests take the hole's pages and fresh ones
            for n in GPU_LENGTHS:
                if pool.pages_for(n) > pool.free_pages:
                    continue
                rid = f"{str(dtype)[6:]}-{page_size}-{n}"
                fill(pool, rid, n, seed=n + page_size)
                ticket = sender.export(pool, rid)
                # torch's handle: a version byte, then 'c' (cudaMalloc segment) or 'e' (expandable
                # segment, shared through pidfd_getfd, which sibling Ray workers may not be allowed)
                kinds = {ticket.handle[p]["handle"][1:2] for p in ("k", "v")}
                if kinds != {b"c"}:
                    raise AssertionError(f"the pool is not in a plain cudaMalloc segment: handle kinds {kinds}")
                out.append(((dtype, page_size), ticket, _host_tokens(pool, rid)))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("tickets", out))
    conn.recv()  # the receiver is done copying: the pools may go
    conn.send(sender.counters())
    sender.close()


@pytest.fixture(scope="module", params=["", "expandable_segments:True"], ids=["plain", "expandable"])
def gpu_tickets(request):
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_gpu_sender, args=(child, request.param), daemon=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(120):
            raise AssertionError("the sender process sent no tickets within 120 s")
        kind, payload = parent.recv()
        if kind != "tickets":
            raise AssertionError(f"the sender process failed: {payload}")
        yield parent, payload
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()


@pytest.mark.gpu
def test_gpu_ipc_between_two_processes_is_bit_exact(gpu_tickets):
    conn, tickets = gpu_tickets
    receiver = CudaIpcReceiver(identity={"replica_id": "D"})
    pools = {}
    try:
        assert len(tickets) >= len(GPU_CONFIGS) * 2
        for config, ticket, want in tickets:
            if config not in pools:
                pools[config] = _gpu_pool(*config, num_pages=64)
                pools[config].reserve("other", 7 * config[1])  # the receiver's page ids differ
            dst = pools[config]
            assert ticket.handle["pid"] != os.getpid()
            pages = run(receiver.receive(ticket, dst))
            assert pages == dst.pages(ticket.request_id) and dst.seq_len(ticket.request_id) == ticket.num_tokens
            assert _same(want, _host_tokens(dst, ticket.request_id)), ticket.request_id
        stats = receiver.counters()
        assert stats["ipc_receives"] == len(tickets) and stats["ipc_failures"] == 0
        assert stats["ipc_mappings_opened"] == 2 * len(GPU_CONFIGS)  # each sender storage opened once
        # another GPU (as the ticket says) and no fallback: refused before any page is taken
        config, ticket, _ = tickets[0]
        dst = pools[config]
        free = dst.free_pages
        elsewhere = dataclasses.replace(ticket, handle={**ticket.handle, "device_uuid": "GPU-elsewhere"})
        with pytest.raises(TransferError) as info:
            run(receiver.receive(elsewhere, dst))
        assert info.value.reason is TransferFailure.UNAVAILABLE and dst.free_pages == free
        # a pool too small for the request: nothing leaks either
        small = _gpu_pool(*config, num_pages=1)
        big = next(t for c, t, _ in tickets if c == config and t.num_pages > 1)
        with pytest.raises(TransferError) as info:
            run(receiver.receive(big, small))
        assert info.value.reason is TransferFailure.POOL_EXHAUSTED and small.free_pages == 1
        for config, pool in pools.items():
            held = sum(len(pool.pages(t.request_id)) for c, t, _ in tickets if c == config)
            assert pool.free_pages == pool.num_pages - 7 - held
    finally:
        receiver.close()
        conn.send("done")
    sender_stats = conn.recv()
    assert sender_stats["ipc_exports"] == len(tickets)


@pytest.mark.gpu
def test_gpu_same_process_reads_its_own_export():
    """CUDA cannot open a handle in the process that made it: a receiver there reads the pool directly."""
    src, dst = _gpu_pool(torch.bfloat16, 16), _gpu_pool(torch.bfloat16, 16)
    dst.reserve("other", 40)
    fill(src, "r", 100, seed=3)
    sender, receiver = CudaIpcSender(), CudaIpcReceiver()
    try:
        ticket = sender.export(src, "r")
        assert ticket.handle["device_uuid"] == str(torch.cuda.get_device_properties(0).uuid)
        run(receiver.receive(ticket, dst))
        assert _same(_host_tokens(src, "r"), _host_tokens(dst, "r"))
    finally:
        sender.close()
        receiver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="the NCCL fallback between cuda:0 and cuda:1 needs 2 GPUs")
def test_gpu_auto_falls_back_to_nccl_between_two_gpus():
    src = _gpu_pool(torch.bfloat16, 16)
    dst = KVPool(KVPoolConfig(num_layers=3, num_kv_heads=2, head_dim=128, page_size=16, dtype=torch.bfloat16,
                              num_pages=48, device="cuda:1"))
    cfg = ChannelConfig(connect_timeout_s=60.0, transfer_timeout_s=30.0)
    send_ch = ChannelSender("cuda:0", identity={"replica_id": "P"}, config=cfg)
    recv_ch = ChannelReceiver("cuda:1", identity={"replica_id": "D"}, config=cfg,
                              call_sender=lambda s, r: send_ch.serve_send(r))
    sender = CudaIpcSender(identity={"replica_id": "P"}, fallback=send_ch)

    async def stage(who, request):
        return await asyncio.to_thread(sender.serve_stage, src, request)

    receiver = CudaIpcReceiver(identity={"replica_id": "D"}, fallback=recv_ch, call_sender=stage)
    try:
        fill(src, "r", 333, seed=5)
        run(receiver.receive(sender.export(src, "r"), dst))
        assert _same(_host_tokens(src, "r"), _host_tokens(dst, "r"))
        assert receiver.counters()["ipc_fallbacks"] == 1 and receiver.counters()["channel_receives"] == 1
    finally:
        sender.close()
        receiver.close()
