"""Page-granular KV shipping between a prefill pool and a decode pool: the header, frames,
and the transports.

Every transfer of one request is described by a :class:`KVFrameHeader` (msgpack): request
id, token and page counts, geometry (layers, page size, KV heads, head_dim), dtype, FP8
scales, payload size and a checksum whose kind it names. The payload is the request's pages
over all layers, K then V, each ``[num_layers, num_pages, page_size, num_kv_heads, head_dim]``
in the pool's dtype (whole pages: the tail of the last page is padding and travels too).

Over the object store the header and payload travel together as a *frame*, one contiguous
``uint8`` buffer

    b"FPKV" | u32 big-endian header length | msgpack header (checksum: CRC-32) | payload

The receiver checks the framing, the header (strict msgpack limits, no ext types, no pickle,
exact key set), the length and the checksum *before* it takes a page, then adopts pages in
its own pool and scatters the payload into them. Any failure after adopting releases those
pages and raises :class:`TransferError` with a :class:`TransferFailure` reason, so callers can
decide between retrying (checksum, truncation, a lost object, an unusable transport) and
failing the request (shape mismatch, malformed data).

Transports (each a :class:`KVSender` and a :class:`KVReceiver`: two classes, or both ends in
one :class:`KVTransport`; ``kv_transfer.choice.choose_transports`` picks a replica's from the
``transport`` option and its placement, :func:`select_transport` from the pool's device alone):
- :class:`LocalTransport`: the frame stays in process (tests, single-process tools).
- :class:`ObjectStoreTransport`: ``ray.put`` of the frame (CPU bytes, so it works across
  nodes whatever the pools' devices); the receiver fetches it with ``ray.get``.
- ``kv_transfer.channel_send.ChannelSender`` / ``kv_transfer.channel_recv.ChannelReceiver``
  ("nccl" between CUDA pools, "gloo" between CPU pools): the header goes through Ray, the
  pages device to device over a 2-rank process group of the pair, in chunks of whole layers,
  each checked by an on-device checksum (``checksum_kind="wsum64"``; the values come with the
  sender's reply, the header says 0).
- ``kv_transfer.ipc_send.CudaIpcSender`` / ``kv_transfer.ipc_recv.CudaIpcReceiver`` ("cuda_ipc",
  CUDA pools on one physical GPU): the receiver maps the sender's pool through CUDA IPC and
  copies the pages device to device (``checksum_kind="none"``); with a fallback (``auto``: the
  NCCL channel's matching end) it moves pages between pools on different GPUs too.

Ownership: the sender keeps its pages until the receiver acknowledges (the service closes
the prefill replica's lease stream once the decode replica has adopted them), so a failed
transfer leaves the sender's copy intact until the lease ends.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import struct
import warnings
import zlib
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np
import torch

from kv_cache.manager import PoolExhausted
from kv_cache.pool import KVPool

from .config import TRANSPORT_OPTIONS


FRAME_MAGIC = b"FPKV"
FRAME_VERSION = 2
_PREFIX = struct.Struct(">4sI")  # magic, header length
MAX_HEADER_BYTES = 16 * 1024
MAX_REQUEST_ID_LEN = 256

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
# "wsum64": channels: kv_transfer.pages.payload_checksum of each chunk, computed on the pool's
# devices; the sender returns them with the send, so a channel header's checksum field is 0;
# "none": no checksum (checksum 0): a device-local copy between two pools on one GPU
# (kv_transfer.ipc), where no wire or staging buffer sits between the bytes read and written.
CHECKSUM_KINDS = ("crc32", "wsum64", "none")


class TransferFailure(str, enum.Enum):
    """Why a transfer failed; ``retryable`` says whether shipping the same pages again can help."""

    MALFORMED = "malformed"  # not a frame, bad header, unknown keys, limits exceeded
    TRUNCATED = "truncated"  # frame shorter or longer than the header says
    CHECKSUM = "checksum"  # payload bytes do not match the header's CRC-32
    SHAPE = "shape"  # geometry or dtype differs from the receiving pool
    REQUEST_MISMATCH = "request_mismatch"  # the frame belongs to another request
    POOL_EXHAUSTED = "pool_exhausted"  # the receiving pool has no room
    LOST = "lost"  # the transport lost the data (sender died, object evicted, channel failed or hung)
    UNAVAILABLE = "unavailable"  # this transport cannot be used for this pair (backend, peer gone)

    @property
    def retryable(self) -> bool:
        """Whether a new attempt can succeed (for LOST/UNAVAILABLE channel transfers: over the
        object store); SHAPE, MALFORMED and REQUEST_MISMATCH are bugs or misconfiguration."""
        return self in (
            TransferFailure.TRUNCATED,
            TransferFailure.CHECKSUM,
            TransferFailure.POOL_EXHAUSTED,
            TransferFailure.LOST,
            TransferFailure.UNAVAILABLE,
        )


class TransferError(RuntimeError):
    """A KV transfer failed; nothing stays allocated on the receiving side."""

    def __init__(self, reason: TransferFailure | str, message: str, request_id: str | None = None) -> None:
        self.reason = TransferFailure(reason)
        self.request_id = request_id
        self.detail = message
        who = f" (request {request_id!r})" if request_id is not None else ""
        super().__init__(f"KV transfer failed [{self.reason.value}]{who}: {message}")

    @property
    def retryable(self) -> bool:
        return self.reason.retryable

    def __reduce__(self):  # typed fields survive Ray's exception shipping
        return (type(self), (self.reason.value, self.detail, self.request_id))


@dataclass(frozen=True)
class KVFrameHeader:
    """The msgpack metadata of one request's pages: the head of a frame (object store) or the
    whole control message of a channel transfer (the payload then travels over the channel).

    ``checksum`` is the payload's CRC-32 when ``checksum_kind`` is ``"crc32"`` (frames). For
    ``"wsum64"`` (channels, see ``kv_transfer.channel``) it is 0 and unused: the export copies
    nothing, so there is nothing to checksum yet; both ends checksum every chunk on their
    device when it moves and the sender returns its values in the ``serve_send`` reply. For
    ``"none"`` (same-GPU copies, see ``kv_transfer.ipc``) it is 0."""

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
                "checksum": struct.pack(">Q", self.checksum & 0xFFFFFFFFFFFFFFFF),
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


def adopt_pages(pool: KVPool, header: KVFrameHeader) -> list[int]:
    """Reserve (all or nothing) the pages ``header``'s request needs in ``pool``."""
    try:
        return pool.adopt(header.request_id, header.num_tokens)
    except PoolExhausted as exc:
        raise TransferError(TransferFailure.POOL_EXHAUSTED, str(exc), header.request_id) from None
    except ValueError as exc:  # already holds pages under this id
        raise TransferError(TransferFailure.REQUEST_MISMATCH, str(exc), header.request_id) from None


# ---------------------------------------------------------------------------- transports
@dataclass(frozen=True)
class TransferTicket:
    """What the sender hands to whoever routes the request to a receiver.

    ``transport`` names the receiver that can take it ("local", "object_store", a channel
    backend: "nccl", "gloo", or "cuda_ipc"). ``handle`` is transport-specific: the frame itself
    (local), a one-element list holding the ``ObjectRef`` (object store; the list keeps Ray
    from resolving the ref when the ticket is passed as an argument), the msgpack header plus
    the sender's address (channels), or the header plus the sender's GPU, pages and CUDA IPC
    handles of its pool (cuda_ipc).

    ``sender``: the replica that holds something for this ticket until the receiver is done
    (its pages under a lease, or the frame's reference), as its Serve app, deployment and
    replica id: where ``release_pages`` goes. None: nothing is held.
    """

    request_id: str
    transport: str
    num_tokens: int
    num_pages: int
    nbytes: int
    handle: Any = field(repr=False, default=None)
    sender: Any = field(repr=False, default=None)


class KVSender(abc.ABC):
    """The sending end of a transport (a prefill replica): ``export`` a request's pages as a
    ticket, ``discard`` it when done, and answer the receiver's side calls: ``serve_send``
    (channels: send the pages now) and ``serve_stage`` (CUDA IPC: stage them on the fallback
    channel). ``serves_sends`` / ``serves_stages`` say whether it answers them; the replica
    refuses a call its sender does not answer, without asking which transport it holds."""

    name: str = "abstract"
    fault_modes: tuple[str, ...] = ()  # what ``export(fault=...)`` can inject
    # True when the receiver reads the pages out of the sender's pool after ``export`` (a
    # channel send, a CUDA IPC copy): the sender keeps them under a lease until then. False
    # when ``export`` copied them (a frame): the sender may free them at once.
    reads_pages_after_export: bool = False
    # True when the sender must keep the exported frame alive until the receiver has fetched it
    # (the object store: see ObjectStoreTransport): the replica holds the ticket under a lease
    # then, but frees the pages at once.
    keeps_frame_until_released: bool = False
    # True when ``serve_send`` can send pages over a channel (the replica's lease then counts
    # the sends): the channels, and CUDA IPC with a channel fallback.
    serves_sends: bool = False
    serves_stages: bool = False  # True when ``serve_stage`` answers (CUDA IPC)

    @abc.abstractmethod
    def export(self, pool: KVPool, request_id: str, *, fault: str | None = None) -> TransferTicket:
        """Ship ``request_id``'s pages; ``fault`` (one of ``fault_modes``) damages the transfer on
        purpose (fault-injection drills and tests)."""

    def discard(self, ticket: TransferTicket) -> None:
        """Sender-side cleanup of a ticket that is done with (received or abandoned)."""

    async def serve_send(self, request: Any) -> Any:
        """A receiver's ``kv_transfer.wire.SendPages``; the ``SendReply`` (with ``serves_sends``)."""
        raise TransferError(TransferFailure.UNAVAILABLE, f"{self.name!r} does not send over channels")

    def serve_stage(self, pool: KVPool, request: Any) -> Any:
        """A receiver's ``kv_transfer.wire.StagePages`` (blocking); the ``StageReply`` (with
        ``serves_stages``)."""
        raise TransferError(TransferFailure.UNAVAILABLE, f"{self.name!r} does not stage pages")

    def counters(self) -> dict[str, int]:
        """Counters for the replica's stats (none by default)."""
        return {}

    def close(self) -> None:
        """Release what the transport holds (connections, threads); the replica is stopping."""


class KVReceiver(abc.ABC):
    """The receiving end of a transport (a decode replica): ``receive`` a ticket's pages into
    a pool (``TransferError`` on failure, nothing left allocated)."""

    name: str = "abstract"
    # True when the sender still holds something for the ticket after a receive (the pages
    # after a CUDA IPC copy, the frame's reference after an object-store fetch): the receiver's
    # replica then calls ``release_pages`` on it at once. False when the transfer itself ended
    # the lease (a channel send) or there was none (a local frame).
    releases_after_receive: bool = False

    @abc.abstractmethod
    async def receive(self, ticket: TransferTicket, pool: KVPool) -> list[int]: ...

    def health_error(self) -> str | None:
        """Why this replica can no longer receive (a CUDA context broken by a copy), or None."""
        return None

    def sweep(self) -> int:
        """Periodic upkeep (the replica's health check calls it); returns what it closed."""
        return 0

    def counters(self) -> dict[str, int]:
        """Counters for the replica's stats (none by default)."""
        return {}

    def close(self) -> None:
        """Release what the transport holds (connections, threads); the replica is stopping."""


class KVTransport(KVSender, KVReceiver):
    """A transport that plays both ends (one instance per replica serves its role's end)."""

    name: str = "abstract"

    def counters(self) -> dict[str, int]:
        return {}

    def close(self) -> None:
        pass


class LocalTransport(KVTransport):
    """In-process frames (tests and single-process tools)."""

    name = "local"
    fault_modes = ("flip", "truncate")

    def export(self, pool: KVPool, request_id: str, *, fault: str | None = None) -> TransferTicket:
        frame = _maybe_corrupt(pack_pages(pool, request_id), fault)
        return _ticket(self.name, pool, request_id, frame, frame)

    async def receive(self, ticket: TransferTicket, pool: KVPool) -> list[int]:
        return adopt_frame(pool, ticket.handle, request_id=ticket.request_id)


class ObjectStoreTransport(KVTransport):
    """Frames through Ray's object store: works across nodes and for CPU or GPU pools (the
    frame is CPU bytes). The sender's process owns the object; when it dies the receiver's
    fetch fails with ``TransferFailure.LOST`` (retryable elsewhere).

    The sender keeps its own reference to the frame until the receiver has fetched it
    (``keeps_frame_until_released``: the prefill replica holds the ticket under a lease, the
    decode replica releases it right after the fetch). Ray's reference counting alone does not
    keep it: Serve returns every reply as an item of a streaming generator, and a reference
    nested in such an item can lose its count before the borrowers down the line fetch it
    (ray-project/ray#58080; ``scripts/ray_nested_ref_repro.py``, docs/notes/object_store_frame_lost.md)."""

    name = "object_store"
    fault_modes = ("flip", "truncate")
    keeps_frame_until_released = True
    releases_after_receive = True

    def __init__(self, fetch_timeout_s: float = 60.0) -> None:
        self.fetch_timeout_s = fetch_timeout_s

    def export(self, pool: KVPool, request_id: str, *, fault: str | None = None) -> TransferTicket:
        import ray

        frame = _maybe_corrupt(pack_pages(pool, request_id), fault)
        return _ticket(self.name, pool, request_id, frame, [ray.put(frame)])

    async def receive(self, ticket: TransferTicket, pool: KVPool) -> list[int]:
        import asyncio

        frame = await self.fetch(ticket)
        # checksum + scatter off the event loop (large frames take a while)
        return await asyncio.to_thread(adopt_frame, pool, frame, request_id=ticket.request_id)

    async def fetch(self, ticket: TransferTicket) -> np.ndarray:
        """The ticket's frame out of the object store (not verified yet: see ``read_frame``)."""
        import asyncio

        import ray

        refs = ticket.handle
        if not isinstance(refs, list) or len(refs) != 1 or not isinstance(refs[0], ray.ObjectRef):
            raise TransferError(TransferFailure.MALFORMED, "ticket: expected [ObjectRef]", ticket.request_id)
        try:
            frame = await asyncio.wait_for(refs[0], timeout=self.fetch_timeout_s)
        except asyncio.TimeoutError:
            raise TransferError(TransferFailure.LOST, f"frame not fetched within {self.fetch_timeout_s}s", ticket.request_id) from None
        except Exception as exc:  # ObjectLostError, OwnerDiedError, ...
            raise TransferError(TransferFailure.LOST, f"{type(exc).__name__}: {exc}", ticket.request_id) from None
        if not isinstance(frame, np.ndarray) or frame.dtype != np.uint8 or frame.ndim != 1:
            # frames are plain uint8 arrays (Ray stores numpy arrays as raw buffers, no pickle)
            raise TransferError(TransferFailure.MALFORMED, f"frame: expected a 1-D uint8 array, got {type(frame).__name__}",
                                ticket.request_id)
        return frame


def _ticket(name: str, pool: KVPool, request_id: str, frame: np.ndarray, handle: Any) -> TransferTicket:
    num_tokens = pool.seq_len(request_id)
    return TransferTicket(request_id, name, num_tokens, pool.pages_for(num_tokens), int(frame.nbytes), handle)


TRANSPORTS = (*TRANSPORT_OPTIONS, "local")  # "local": tests and single-process tools
# What ``auto`` means for CUDA pools: CUDA IPC when the receiver's pool is on the sender's GPU,
# the NCCL channel otherwise (each CUDA IPC end with the channel's matching end as fallback).
IPC_OR_NCCL = "cuda_ipc+nccl"


def select_transport(requested: str, *, device: str | torch.device) -> str:
    """Which transport a replica whose KV pool lives on ``device`` exports with.

    ``auto``: for CUDA pools :data:`IPC_OR_NCCL` (CUDA IPC between pools on one physical GPU,
    where NCCL refuses two ranks on one device; the NCCL channel between GPUs), else the object
    store. ``cuda_ipc`` alone (CUDA pools only) fails a transfer to a pool on another GPU,
    which the service then retries over the object store. ``nccl`` (channels between CUDA
    pools) and ``gloo`` (the same channels between CPU pools: tests, CPU-only clusters) are
    refused with ``ValueError`` where the pool's device does not fit: a configuration error, not
    a silent slowdown.
    """
    if requested not in TRANSPORTS:
        raise ValueError(f"transport: expected one of {TRANSPORTS}, got {requested!r}")
    kind = torch.device(device).type
    if requested == "auto":
        return IPC_OR_NCCL if kind == "cuda" else "object_store"
    if requested in ("nccl", "cuda_ipc") and kind != "cuda":
        raise ValueError(
            f"transport: {requested!r} needs a CUDA KV pool, this one is on {device}; "
            "use 'gloo' (channels between CPU pools), 'object_store' or 'auto'"
        )
    if requested == "gloo" and kind != "cpu":
        raise ValueError(f"transport: 'gloo' moves CPU KV pools, this one is on {device}; use 'nccl' or 'auto'")
    return requested


def _maybe_corrupt(frame: np.ndarray, fault: str | None) -> np.ndarray:
    return frame if fault is None else corrupt_frame(frame, fault)


def corrupt_frame(frame: np.ndarray, mode: str) -> np.ndarray:
    """Fault injection for tests and drills: ``"flip"`` one payload byte, ``"truncate"`` the tail."""
    if mode == "flip":
        bad = frame.copy()
        bad[-1] ^= 0xFF
        return bad
    if mode == "truncate":
        return frame[: max(len(frame) - 7, 0)].copy()
    raise ValueError(f"mode: expected 'flip' or 'truncate', got {mode!r}")
