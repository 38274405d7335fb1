"""The header of one request's pages (:class:`KVFrameHeader`, msgpack) and its checks
against a pool: what every transport sends first, whatever carries the payload.

The header names the request, its token and page counts, the geometry (layers, page size, KV
heads, head_dim), the dtype, FP8 scales, the payload size and a checksum whose kind it names.
The payload it describes is the request's pages over all layers, K then V, each ``[num_layers,
num_pages, page_size, num_kv_heads, head_dim]`` in the pool's dtype (whole pages: the tail of
the last page is padding and travels too). :func:`describe_pages` makes one from a pool,
:func:`check_geometry` checks one against the receiving pool, :func:`adopt_pages` reserves the
receiving pages (all or nothing).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from kv_cache.manager import PoolExhausted
from kv_cache.pool import KVPool

from .errors import TransferError, TransferFailure
from .wire import MAX_REQUEST_ID_LEN, _U64  # noqa: F401 - header's names too (the channel ends import them here)

FRAME_VERSION = 2

_DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn,
}
_DTYPE_NAMES = {v: k for k, v in _DTYPES.items()}

_HEADER_KEYS = frozenset(
    {
        "version", "request_id", "num_tokens", "num_pages", "page_size", "num_layers",
        "num_kv_heads", "head_dim", "dtype", "payload_bytes", "checksum", "checksum_kind",
        "k_scale", "v_scale",
    }
)
# "crc32": CRC-32 of the payload bytes, in the header (frames: computed on the host anyway);
# "wsum64": channels: kv_transfer.channel.pages.payload_checksum of each chunk, computed on the pool's
# devices; the sender returns them with the send, so a channel header's checksum field is 0;
# "none": no checksum (checksum 0): a device-local copy between two pools on one GPU
# (kv_transfer.cuda_ipc), where no wire or staging buffer sits between the bytes read and written.
CHECKSUM_KINDS = ("crc32", "wsum64", "none")


@dataclass(frozen=True)
class KVFrameHeader:
    """The msgpack metadata of one request's pages: the head of a frame (object store) or the
    whole control message of a channel transfer (the payload then travels over the channel).

    ``checksum`` is the payload's CRC-32 when ``checksum_kind`` is ``"crc32"`` (frames). For
    ``"wsum64"`` (channels, see ``kv_transfer.channel``) it is 0 and unused: the export copies
    nothing, so there is nothing to checksum yet; both ends checksum every chunk on their
    device when it moves and the sender returns its values in the ``serve_send`` reply. For
    ``"none"`` (same-GPU copies, see ``kv_transfer.cuda_ipc``) it is 0."""

    request_id: str
    num_tokens: int
    num_pages: int
    page_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    payload_bytes: int
    checksum: int
    k_scale: tuple[float, ...] | None = None
    v_scale: tuple[float, ...] | None = None
    checksum_kind: str = "crc32"
    version: int = FRAME_VERSION

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def page_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of K (and of V) in the payload."""
        return (self.num_layers, self.num_pages, self.page_size, self.num_kv_heads, self.head_dim)

    def encode(self) -> bytes:
        # the checksum as 8 fixed bytes: the header length does not depend on its value, so
        # the frame can be laid out before the payload is gathered into it.
        return msgpack.packb(
            {
                "version": self.version,
                "request_id": self.request_id,
                "num_tokens": self.num_tokens,
                "num_pages": self.num_pages,
                "page_size": self.page_size,
                "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim,
                "dtype": self.dtype,
                "payload_bytes": self.payload_bytes,
                "checksum": struct.pack(">Q", self.checksum & _U64),
                "checksum_kind": self.checksum_kind,
                "k_scale": list(self.k_scale) if self.k_scale is not None else None,
                "v_scale": list(self.v_scale) if self.v_scale is not None else None,
            },
            use_bin_type=True,
        )

    @classmethod
    def decode(cls, raw: bytes | memoryview) -> "KVFrameHeader":
        """Strict parse: size limits, no ext types, exact key set, typed fields."""

        def no_ext(code: int, data: bytes) -> Any:
            raise ValueError(f"ext type {code} is not allowed")

        try:
            obj = msgpack.unpackb(
                bytes(raw),
                raw=False,
                strict_map_key=True,
                use_list=True,
                ext_hook=no_ext,
                max_str_len=MAX_REQUEST_ID_LEN * 4,
                max_bin_len=16,
                max_array_len=4096,
                max_map_len=len(_HEADER_KEYS),
                max_ext_len=0,
            )
        except Exception as exc:  # msgpack raises several types for bad input
            raise TransferError(TransferFailure.MALFORMED, f"header is not valid msgpack: {exc}") from None
        if not isinstance(obj, dict):
            raise TransferError(TransferFailure.MALFORMED, f"header: expected a map, got {type(obj).__name__}")
        if set(obj) != _HEADER_KEYS:
            missing = sorted(_HEADER_KEYS - set(obj))
            extra = sorted(str(k) for k in set(obj) - _HEADER_KEYS)
            raise TransferError(TransferFailure.MALFORMED, f"header keys: missing {missing}, unexpected {extra}")
        rid = obj.get("request_id")
        if obj["version"] != FRAME_VERSION:
            raise TransferError(
                TransferFailure.MALFORMED, f"version: expected {FRAME_VERSION}, got {obj['version']!r}", rid
            )
        if not isinstance(rid, str) or not rid or len(rid) > MAX_REQUEST_ID_LEN:
            raise TransferError(TransferFailure.MALFORMED, f"request_id: expected a short non-empty str, got {rid!r}")
        for key, minimum in (
            ("num_tokens", 0), ("num_pages", 0), ("page_size", 1), ("num_layers", 1),
            ("num_kv_heads", 1), ("head_dim", 1), ("payload_bytes", 0),
        ):
            value = obj[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise TransferError(TransferFailure.MALFORMED, f"{key}: expected an int >= {minimum}, got {value!r}", rid)
        if obj["dtype"] not in _DTYPES:
            raise TransferError(TransferFailure.MALFORMED, f"dtype: expected one of {sorted(_DTYPES)}, got {obj['dtype']!r}", rid)
        checksum = obj["checksum"]
        if not isinstance(checksum, bytes) or len(checksum) != 8:
            raise TransferError(TransferFailure.MALFORMED, "checksum: expected 8 bytes", rid)
        checksum = struct.unpack(">Q", checksum)[0]
        if obj["checksum_kind"] not in CHECKSUM_KINDS:
            raise TransferError(
                TransferFailure.MALFORMED, f"checksum_kind: expected one of {CHECKSUM_KINDS}, got {obj['checksum_kind']!r}", rid
            )
        if obj["checksum_kind"] == "crc32" and checksum > 0xFFFFFFFF:
            raise TransferError(TransferFailure.MALFORMED, "checksum: a CRC-32 has 32 bits", rid)
        if obj["checksum_kind"] == "none" and checksum != 0:
            raise TransferError(TransferFailure.MALFORMED, "checksum: expected 0 with checksum_kind 'none'", rid)
        scales = []
        for key in ("k_scale", "v_scale"):
            s = obj[key]
            if s is not None and (
                not isinstance(s, list) or len(s) != obj["num_layers"] * obj["num_kv_heads"]
                or not all(isinstance(x, float) for x in s)
            ):
                raise TransferError(TransferFailure.MALFORMED, f"{key}: expected None or num_layers*num_kv_heads floats", rid)
            scales.append(tuple(s) if s is not None else None)
        header = cls(
            request_id=rid,
            num_tokens=obj["num_tokens"],
            num_pages=obj["num_pages"],
            page_size=obj["page_size"],
            num_layers=obj["num_layers"],
            num_kv_heads=obj["num_kv_heads"],
            head_dim=obj["head_dim"],
            dtype=obj["dtype"],
            payload_bytes=obj["payload_bytes"],
            checksum=checksum,
            k_scale=scales[0],
            v_scale=scales[1],
            checksum_kind=obj["checksum_kind"],
        )
        if header.num_pages != -(-header.num_tokens // header.page_size):
            raise TransferError(
                TransferFailure.MALFORMED,
                f"num_pages: expected ceil(num_tokens / page_size) = "
                f"{-(-header.num_tokens // header.page_size)}, got {header.num_pages}",
                rid,
            )
        elem = torch.empty((), dtype=header.torch_dtype).element_size()
        want = 2 * elem * int(np.prod(header.page_shape))
        if header.payload_bytes != want:
            raise TransferError(
                TransferFailure.MALFORMED,
                f"payload_bytes: expected {want} for K+V of shape {header.page_shape} {header.dtype}, "
                f"got {header.payload_bytes}",
                rid,
            )
        return header


def _pool_scales(pool: KVPool) -> tuple[tuple[float, ...] | None, tuple[float, ...] | None]:
    if pool.k_scale is None:
        return None, None
    return (
        tuple(float(x) for x in pool.k_scale.flatten().tolist()),
        tuple(float(x) for x in pool.v_scale.flatten().tolist()),
    )


def describe_pages(pool: KVPool, request_id: str, *, checksum_kind: str = "crc32") -> tuple[KVFrameHeader, list[int]]:
    """The header (checksum 0: frames fill it in once the payload is gathered, channels leave
    it) and the pages that carry ``request_id``'s committed tokens. Pages reserved beyond
    ``seq_len`` are left out."""
    pages = pool.pages(request_id)
    num_tokens = pool.seq_len(request_id)
    needed = pool.pages_for(num_tokens)
    if needed > len(pages):
        raise ValueError(f"request_id: {request_id!r} holds {len(pages)} pages, fewer than its {num_tokens} tokens need")
    pages = pages[:needed]
    k_scale, v_scale = _pool_scales(pool)
    elem = pool.k.element_size()
    one = pool.num_layers * len(pages) * pool.page_size * pool.num_kv_heads * pool.head_dim * elem
    header = KVFrameHeader(
        request_id=request_id, num_tokens=num_tokens, num_pages=len(pages), page_size=pool.page_size,
        num_layers=pool.num_layers, num_kv_heads=pool.num_kv_heads, head_dim=pool.head_dim,
        dtype=_DTYPE_NAMES[pool.dtype], payload_bytes=2 * one, checksum=0, k_scale=k_scale, v_scale=v_scale,
        checksum_kind=checksum_kind,
    )
    return header, pages


def check_geometry(header: KVFrameHeader, pool: KVPool) -> None:
    """``TransferFailure.SHAPE`` unless ``header`` describes pages ``pool`` can hold as they are."""
    want = (pool.num_layers, pool.page_size, pool.num_kv_heads, pool.head_dim, _DTYPE_NAMES[pool.dtype])
    got = (header.num_layers, header.page_size, header.num_kv_heads, header.head_dim, header.dtype)
    if want != got:
        raise TransferError(
            TransferFailure.SHAPE,
            f"(num_layers, page_size, num_kv_heads, head_dim, dtype): the receiving pool has {want}, the frame {got}",
            header.request_id,
        )
    k_scale, v_scale = _pool_scales(pool)
    if (header.k_scale, header.v_scale) != (k_scale, v_scale):
        raise TransferError(TransferFailure.SHAPE, "FP8 scales differ between the sender's and the receiver's pool", header.request_id)


def adopt_pages(pool: KVPool, header: KVFrameHeader) -> list[int]:
    """Reserve (all or nothing) the pages ``header``'s request needs in ``pool``."""
    try:
        return pool.adopt(header.request_id, header.num_tokens)
    except PoolExhausted as exc:
        raise TransferError(TransferFailure.POOL_EXHAUSTED, str(exc), header.request_id) from None
    except ValueError as exc:  # already holds pages under this id
        raise TransferError(TransferFailure.REQUEST_MISMATCH, str(exc), header.request_id) from None

