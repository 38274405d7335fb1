"""Frames: one request's header and pages in one contiguous ``uint8`` buffer (CPU bytes),
what the object store and the local transport carry and the TP group transfers cut by head:

    b"FPKV" | u32 big-endian header length | msgpack header (checksum: CRC-32) | payload

The receiver checks the framing, the header (strict msgpack limits, no ext types, no pickle,
exact key set), the length and the checksum *before* it takes a page, then adopts pages in
its own pool and scatters the payload into them (:func:`adopt_frame`). Any failure after
adopting releases those pages and raises ``TransferError``.
"""

from __future__ import annotations

import dataclasses
import struct
import warnings
import zlib
from typing import Any

import numpy as np
import torch

from kv_cache.pool import KVPool

from .errors import TransferError, TransferFailure
from .header import KVFrameHeader, adopt_pages, check_geometry, describe_pages
from .interfaces import TransferTicket

FRAME_MAGIC = b"FPKV"
_PREFIX = struct.Struct(">4sI")  # magic, header length
MAX_HEADER_BYTES = 16 * 1024


def pack_pages(pool: KVPool, request_id: str) -> np.ndarray:
    """Gather ``request_id``'s pages (all layers, K then V) into one frame (``uint8`` numpy,
    CPU). The pages stay allocated in ``pool``: the caller releases them after the ack."""
    header, pages = describe_pages(pool, request_id)
    one = header.payload_bytes // 2
    raw_header = header.encode()
    if len(raw_header) > MAX_HEADER_BYTES:
        raise ValueError(f"request_id: header of {len(raw_header)} bytes exceeds {MAX_HEADER_BYTES}")
    start = _PREFIX.size + len(raw_header)
    frame = np.empty(start + 2 * one, dtype=np.uint8)
    index = torch.tensor(pages, dtype=torch.long, device=pool.device)
    out = torch.from_numpy(frame[start:])
    for part, src in enumerate((pool.k_raw, pool.v_raw)):  # page-major storage (FP8 V token-major)
        # one gather per tensor, straight into the frame (a device copy for GPU pools)
        gathered = src.view(torch.uint8).index_select(1, index)
        out[part * one : (part + 1) * one].copy_(gathered.reshape(-1).cpu())
    crc = zlib.crc32(memoryview(frame[start:]))
    header = dataclasses.replace(header, checksum=crc)
    raw_header = header.encode()
    frame[: _PREFIX.size] = np.frombuffer(_PREFIX.pack(FRAME_MAGIC, len(raw_header)), dtype=np.uint8)
    frame[_PREFIX.size : start] = np.frombuffer(raw_header, dtype=np.uint8)
    return frame


def read_frame(frame: Any, *, verify_checksum: bool = True) -> tuple[KVFrameHeader, memoryview]:
    """Parse and check a frame without touching any pool: (header, payload view)."""
    try:
        buf = memoryview(frame).cast("B")
    except TypeError:
        raise TransferError(TransferFailure.MALFORMED, f"frame: expected a bytes-like buffer, got {type(frame).__name__}") from None
    if len(buf) < _PREFIX.size:
        raise TransferError(TransferFailure.TRUNCATED, f"frame: {len(buf)} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, header_len = _PREFIX.unpack(bytes(buf[: _PREFIX.size]))
    if magic != FRAME_MAGIC:
        raise TransferError(TransferFailure.MALFORMED, f"frame: expected magic {FRAME_MAGIC!r}, got {magic!r}")
    if header_len > MAX_HEADER_BYTES:
        raise TransferError(TransferFailure.MALFORMED, f"frame: header length {header_len} exceeds {MAX_HEADER_BYTES}")
    if len(buf) < _PREFIX.size + header_len:
        raise TransferError(TransferFailure.TRUNCATED, "frame: ends inside its header")
    header = KVFrameHeader.decode(buf[_PREFIX.size : _PREFIX.size + header_len])
    if header.checksum_kind != "crc32":
        raise TransferError(
            TransferFailure.MALFORMED, f"checksum_kind: frames carry a CRC-32, got {header.checksum_kind!r}", header.request_id
        )
    payload = buf[_PREFIX.size + header_len :]
    if len(payload) != header.payload_bytes:
        raise TransferError(
            TransferFailure.TRUNCATED,
            f"payload: expected {header.payload_bytes} bytes, got {len(payload)}",
            header.request_id,
        )
    if verify_checksum:
        crc = zlib.crc32(payload)
        if crc != header.checksum:
            raise TransferError(
                TransferFailure.CHECKSUM,
                f"payload CRC-32 {crc:08x} does not match the header's {header.checksum:08x}",
                header.request_id,
            )
    return header, payload


def adopt_frame(pool: KVPool, frame: Any, *, request_id: str | None = None) -> list[int]:
    """Receive side: verify ``frame``, adopt pages for its request in ``pool`` and scatter the
    payload into them. Returns the new page list. On any failure nothing stays allocated."""
    header, payload = read_frame(frame)
    if request_id is not None and header.request_id != request_id:
        raise TransferError(
            TransferFailure.REQUEST_MISMATCH,
            f"expected the pages of {request_id!r}, got those of {header.request_id!r}",
            request_id,
        )
    check_geometry(header, pool)
    pages = adopt_pages(pool, header)
    try:
        one = header.payload_bytes // 2
        with warnings.catch_warnings():  # read-only buffers (Ray's zero-copy get): we only read
            warnings.simplefilter("ignore", UserWarning)
            raw = torch.frombuffer(payload, dtype=torch.uint8) if len(payload) else torch.empty(0, dtype=torch.uint8)
        index = torch.tensor(pages, dtype=torch.long, device=pool.device)
        for part, dst in enumerate((pool.k_raw, pool.v_raw)):
            # bytes, not elements: index_copy_ has no FP8 kernels, and the copy is exact anyway
            dst_bytes = dst.view(torch.uint8)
            block = raw[part * one : (part + 1) * one].view(dst_bytes.shape[0], -1, *dst_bytes.shape[2:])
            dst_bytes.index_copy_(1, index, block.to(pool.device))
    except BaseException:
        pool.release(header.request_id)
        raise
    return pages



def frame_ticket(name: str, pool: KVPool, request_id: str, frame: np.ndarray, handle: Any) -> TransferTicket:
    """The ticket of a frame shipped by transport ``name`` (``handle``: how its receiver finds it)."""
    num_tokens = pool.seq_len(request_id)
    return TransferTicket(request_id, name, num_tokens, pool.pages_for(num_tokens), int(frame.nbytes), handle)
