"""KV page shipping: frame format, checksum/shape checks, page accounting on both sides."""

from __future__ import annotations

import asyncio
import struct

import msgpack
import numpy as np
import pytest
import torch

from kv_cache import KVPool, KVPoolConfig
from kv_transfer.transfer import (
    FRAME_MAGIC,
    KVFrameHeader,
    LocalTransport,
    TransferError,
    TransferFailure,
    adopt_frame,
    corrupt_frame,
    pack_pages,
    read_frame,
    select_transport,
)


def make_pool(num_pages=16, page_size=8, dtype=torch.float32, num_layers=3, heads=2, head_dim=4) -> KVPool:
    return KVPool(
        KVPoolConfig(num_layers=num_layers, num_kv_heads=heads, head_dim=head_dim,
                     page_size=page_size, dtype=dtype, num_pages=num_pages)
    )


def fill(pool: KVPool, rid: str, num_tokens: int, seed: int = 0) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.reserve(rid, num_tokens)
    slots = pool.slot_mapping([rid], [0], [num_tokens])
    for layer in range(pool.num_layers):
        k = torch.randn(num_tokens, pool.num_kv_heads, pool.head_dim, generator=g).to(pool.device)
        v = torch.randn(num_tokens, pool.num_kv_heads, pool.head_dim, generator=g).to(pool.device)
        pool.write(layer, slots, k, v)
    pool.set_seq_len(rid, num_tokens)


def tokens_of(pool: KVPool, rid: str) -> tuple[torch.Tensor, torch.Tensor]:
    n = pool.seq_len(rid)
    slots = pool.slot_mapping([rid], [0], [n])
    k = torch.stack([pool.k[l].reshape(-1, pool.num_kv_heads, pool.head_dim)[slots] for l in range(pool.num_layers)])
    v = torch.stack([pool.v[l].reshape(-1, pool.num_kv_heads, pool.head_dim)[slots] for l in range(pool.num_layers)])
    return k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 8, 21])
def test_roundtrip_exact(dtype, num_tokens):
    src, dst = make_pool(dtype=dtype), make_pool(dtype=dtype)
    dst.reserve("other", 10)  # the receiver's page ids differ from the sender's
    fill(src, "r", num_tokens, seed=num_tokens)
    frame = pack_pages(src, "r")
    pages = adopt_frame(dst, frame, request_id="r")
    assert pages == dst.pages("r") and dst.seq_len("r") == num_tokens
    assert pages != src.pages("r")
    for a, b in zip(tokens_of(src, "r"), tokens_of(dst, "r")):
        assert torch.equal(a, b)
    # the sender still owns its pages until it is told to release them
    assert src.has("r")


def test_header_is_msgpack_with_crc():
    src = make_pool()
    fill(src, "req-1", 13)
    frame = pack_pages(src, "req-1")
    assert bytes(frame[:4]) == FRAME_MAGIC
    (hlen,) = struct.unpack(">I", bytes(frame[4:8]))
    obj = msgpack.unpackb(bytes(frame[8 : 8 + hlen]), raw=False)
    assert obj["request_id"] == "req-1" and obj["num_tokens"] == 13 and obj["num_pages"] == 2
    header, payload = read_frame(frame)
    assert header.payload_bytes == len(payload) == 2 * 3 * 2 * 8 * 2 * 4 * 4


@pytest.mark.parametrize("mode,reason", [("flip", TransferFailure.CHECKSUM), ("truncate", TransferFailure.TRUNCATED)])
def test_corrupt_or_truncated_frame_frees_nothing_taken(mode, reason):
    src, dst = make_pool(), make_pool()
    fill(src, "r", 20)
    bad = corrupt_frame(pack_pages(src, "r"), mode)
    with pytest.raises(TransferError) as info:
        adopt_frame(dst, bad, request_id="r")
    assert info.value.reason is reason and info.value.retryable
    assert dst.free_pages == dst.num_pages and not dst.has("r")
    # retry from the sender's still-held pages works
    adopt_frame(dst, pack_pages(src, "r"), request_id="r")
    assert dst.has("r")
    src.release("r")
    dst.release("r")
    assert src.free_pages == src.num_pages and dst.free_pages == dst.num_pages


def test_shape_and_dtype_mismatch():
    src = make_pool(head_dim=4)
    fill(src, "r", 9)
    frame = pack_pages(src, "r")
    for dst in (make_pool(head_dim=8), make_pool(page_size=4), make_pool(dtype=torch.float16)):
        with pytest.raises(TransferError) as info:
            adopt_frame(dst, frame)
        assert info.value.reason is TransferFailure.SHAPE and not info.value.retryable
        assert dst.free_pages == dst.num_pages


def test_request_mismatch_and_exhausted():
    src, dst = make_pool(), make_pool(num_pages=2)
    fill(src, "r", 30)  # 4 pages
    frame = pack_pages(src, "r")
    with pytest.raises(TransferError) as info:
        adopt_frame(dst, frame, request_id="someone-else")
    assert info.value.reason is TransferFailure.REQUEST_MISMATCH
    with pytest.raises(TransferError) as info:
        adopt_frame(dst, frame)
    assert info.value.reason is TransferFailure.POOL_EXHAUSTED and info.value.retryable
    assert dst.free_pages == 2


def _frame_with_header(obj: dict, payload: bytes = b"") -> bytes:
    raw = msgpack.packb(obj, use_bin_type=True)
    return FRAME_MAGIC + struct.pack(">I", len(raw)) + raw + payload


def test_malformed_headers_rejected():
    src = make_pool()
    fill(src, "r", 5)
    frame = pack_pages(src, "r")
    header, payload = read_frame(frame)
    good = msgpack.unpackb(header.encode(), raw=False)
    cases = [
        b"",  # empty
        b"XXXX" + bytes(frame[4:]),  # magic
        FRAME_MAGIC + struct.pack(">I", 1 << 30),  # header length over the limit
        _frame_with_header([1, 2, 3]),  # not a map
        _frame_with_header({**good, "extra": 1}, bytes(payload)),  # unknown key
        _frame_with_header({**good, "num_tokens": -1}, bytes(payload)),
        _frame_with_header({**good, "dtype": "int8"}, bytes(payload)),
        _frame_with_header({**good, "num_pages": 7}, bytes(payload)),
        _frame_with_header({**good, "payload_bytes": 3}, bytes(payload)),
        FRAME_MAGIC + struct.pack(">I", 3) + b"\xd4\x01\x00",  # an ext type
        FRAME_MAGIC + struct.pack(">I", 5) + b"\xdb\xff\xff\xff\xff",  # str32 claiming 4 GiB
    ]
    for raw in cases:
        with pytest.raises(TransferError) as info:
            read_frame(raw)
        assert info.value.reason in (TransferFailure.MALFORMED, TransferFailure.TRUNCATED), raw[:16]
    with pytest.raises(TransferError):
        read_frame("not bytes")


def test_header_roundtrip_and_error_pickles():
    import pickle  # only to check Ray can ship the typed error; never used on peer data

    h = KVFrameHeader("x", 3, 1, 8, 2, 2, 4, "float32", 2 * 2 * 8 * 2 * 4 * 4, 0xDEADBEEF)
    assert KVFrameHeader.decode(h.encode()) == h
    err = pickle.loads(pickle.dumps(TransferError(TransferFailure.CHECKSUM, "boom", "r")))
    assert err.reason is TransferFailure.CHECKSUM and err.request_id == "r" and err.retryable


def test_local_transport_sender_keeps_pages_until_release():
    src, dst = make_pool(), make_pool()
    fill(src, "r", 17)
    t = LocalTransport()
    ticket = t.export(src, "r")
    assert ticket.num_tokens == 17 and ticket.num_pages == 3 and ticket.nbytes > 0
    pages = asyncio.run(t.receive(ticket, dst))
    assert len(pages) == 3 and src.has("r")
    src.release("r")
    dst.release("r")
    bad = t.export(make_pool_with(src, "q"), "q", fault="flip")
    with pytest.raises(TransferError):
        asyncio.run(t.receive(bad, dst))
    assert dst.free_pages == dst.num_pages


def make_pool_with(pool: KVPool, rid: str) -> KVPool:
    fill(pool, rid, 11)
    return pool


def test_fp8_scales_must_match():
    src = make_pool(dtype=torch.float8_e4m3fn)
    dst = make_pool(dtype=torch.float8_e4m3fn)
    fill(src, "r", 9)
    adopt_frame(dst, pack_pages(src, "r"))
    dst.release("r")
    for layer in range(dst.num_layers):
        dst.set_scales(layer, 2.0, 2.0)
    with pytest.raises(TransferError) as info:
        adopt_frame(dst, pack_pages(src, "r"))
    assert info.value.reason is TransferFailure.SHAPE


def test_select_transport():
    assert select_transport("auto", device="cpu") == "object_store"
    # CUDA: IPC between pools on one GPU, the NCCL channel between GPUs (kv_transfer.cuda_ipc)
    assert select_transport("auto", device="cuda:1") == "cuda_ipc+nccl"
    assert select_transport("object_store", device="cuda") == "object_store"
    assert select_transport("nccl", device="cuda") == "nccl"
    assert select_transport("cuda_ipc", device=torch.device("cuda", 0)) == "cuda_ipc"
    assert select_transport("gloo", device="cpu") == "gloo"
    # refused where the pool's device does not fit, naming what would
    with pytest.raises(ValueError, match=r"^transfer\.transport: 'nccl' moves CUDA KV pools, this one is on cpu; "
                                         r"use one of \('auto', 'object_store', 'gloo'\)"):
        select_transport("nccl", device="cpu")
    with pytest.raises(ValueError, match="^transfer.transport: 'cuda_ipc' moves CUDA KV pools"):
        select_transport("cuda_ipc", device="cpu")
    with pytest.raises(ValueError, match=r"^transfer\.transport: 'gloo' moves CPU KV pools, this one is on cuda; "
                                         r"use one of \('auto', 'object_store', 'nccl', 'cuda_ipc'\)"):
        select_transport("gloo", device="cuda")
    # an unknown name: the option and every registered transport
    with pytest.raises(ValueError, match=r"^transfer\.transport: expected one of \('object_store', 'nccl', 'cuda_ipc', "
                                         r"'gloo', 'local'\) \(or 'auto'\), got 'rdma'"):
        select_transport("rdma", device="cpu")


def test_frames_carry_crc32_only():
    src = make_pool()
    fill(src, "r", 5)
    frame = pack_pages(src, "r")
    header, payload = read_frame(frame)
    assert header.checksum_kind == "crc32" and header.checksum < 2**32
    other = KVFrameHeader(**{**header.__dict__, "checksum_kind": "wsum64"}).encode()
    bad = FRAME_MAGIC + struct.pack(">I", len(other)) + other + bytes(payload)
    with pytest.raises(TransferError, match="frames carry a CRC-32") as info:
        read_frame(bad)
    assert info.value.reason is TransferFailure.MALFORMED


def test_empty_request():
    src, dst = make_pool(), make_pool()
    src.reserve("e", 0)
    frame = pack_pages(src, "e")
    assert adopt_frame(dst, frame) == [] and dst.has("e")
    assert isinstance(frame, np.ndarray)
