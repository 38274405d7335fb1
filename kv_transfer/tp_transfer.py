"""KV transfer between tensor-parallel groups of any sizes (prefill TP ``P`` -> decode TP ``D``).

Each prefill rank holds the pages of its own KV heads (``kv_cache.heads``); each decode rank
needs exactly its own heads. :func:`kv_transfer.routes.transfer_routes` says which prefill rank
sends which heads to which decode rank; every (source, destination) pair moves one ordinary
frame (``kv_transfer.frame``: magic, msgpack header, CRC-32 over the payload) whose pages are
restricted to the pair's heads, in the destination's order (the header's ``num_kv_heads`` is the
frame's head count, its FP8 scales those heads' scales). So the framing, the checks and the
object-store and local transports are the existing ones, frame by frame.

All or nothing, over the whole group:
- one decode rank verifies *every* frame it needs (framing, CRC, geometry, scales, token count)
  before it takes a page, then adopts its pages once and scatters each frame's heads into them
  (:func:`adopt_head_frames`; a failure releases them);
- the group then agrees (:func:`agree`: a MIN all-reduce of each rank's outcome over the decode
  group's process group, or the driver's own tally when the ranks' results come back to it):
  if any rank failed, every rank releases the request's pages and the transfer raises the
  failing rank's :class:`TransferError` (retryable as that reason is). Nothing stays allocated
  on any rank after a failure; the prefill ranks keep their pages until the lease ends, so the
  retry ships the same pages again.

:func:`merge_frames` assembles the frames a prefill group ships to one decode rank into the
ordinary TP=1 frame (byte for byte what ``pack_pages`` gives for the unsharded pool), so a TP
prefill replica can feed a TP=1 decode replica over the existing single-frame transports.
:func:`split_frame` is its converse on the receive side of a TP decode replica: one ordinary
frame, verified whole, cut into each decode rank's frame of exactly its KV heads
(:func:`adopt_rank_frame` adopts one, :func:`settle` is the driver's all-or-nothing tally).
The object store's group ends (``kv_transfer.object_store.group``) use them; the channels move
heads between groups their own way (``kv_transfer.channel.group``).
"""

from __future__ import annotations

import dataclasses
import warnings
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from kv_cache.heads import HeadLayout
from kv_cache.pool import KVPool

from .errors import TransferError, TransferFailure
from .frame import FRAME_MAGIC, MAX_HEADER_BYTES, _PREFIX, read_frame
from .header import adopt_pages, describe_pages, _DTYPE_NAMES, KVFrameHeader
from .routes import HeadRoute, transfer_routes


def _head_dim_of(pool: KVPool, part: int) -> int:
    """The heads' dimension in ``k_raw`` (part 0) / ``v_raw`` (part 1; FP8 V is token-major)."""
    return 2 if part == 1 and pool.config.v_token_major else 3


def _check_heads(pool: KVPool, heads: Sequence[int]) -> list[int]:
    heads = list(heads)
    if not heads or any(isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < pool.num_kv_heads
                        for h in heads) or len(set(heads)) != len(heads):
        raise ValueError(f"heads: expected distinct local KV heads in [0, {pool.num_kv_heads}), got {heads}")
    return heads


def pack_heads(pool: KVPool, request_id: str, heads: Sequence[int]) -> np.ndarray:
    """A frame of ``request_id``'s pages restricted to the local KV heads ``heads`` (in that
    order). The pages stay allocated in ``pool``."""
    heads = _check_heads(pool, heads)
    header, pages = describe_pages(pool, request_id)
    per_head = header.payload_bytes // 2 // pool.num_kv_heads
    one = per_head * len(heads)
    k_scale = v_scale = None
    if pool.k_scale is not None:
        k_scale = tuple(float(x) for x in pool.k_scale[:, heads].flatten().tolist())
        v_scale = tuple(float(x) for x in pool.v_scale[:, heads].flatten().tolist())
    header = dataclasses.replace(header, num_kv_heads=len(heads), payload_bytes=2 * one, k_scale=k_scale,
                                 v_scale=v_scale)
    page_index = torch.tensor(pages, dtype=torch.long, device=pool.device)
    head_index = torch.tensor(heads, dtype=torch.long, device=pool.device)
    payload = np.empty(2 * one, dtype=np.uint8)
    out = torch.from_numpy(payload)
    for part, src in enumerate((pool.k_raw, pool.v_raw)):
        gathered = src.view(torch.uint8).index_select(1, page_index).index_select(_head_dim_of(pool, part), head_index)
        out[part * one:(part + 1) * one].copy_(gathered.reshape(-1).cpu())
    header = dataclasses.replace(header, checksum=zlib.crc32(memoryview(payload)))
    raw = header.encode()
    if len(raw) > MAX_HEADER_BYTES:
        raise ValueError(f"request_id: header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    return np.concatenate([np.frombuffer(_PREFIX.pack(FRAME_MAGIC, len(raw)) + raw, dtype=np.uint8), payload])


def export_rank(pool: KVPool, request_id: str, src: HeadLayout, dst: HeadLayout, rank: int) -> dict[int, np.ndarray]:
    """The frames prefill rank ``rank`` ships: ``{decode rank: frame}``."""
    out = {}
    for (s, d), routes in transfer_routes(src, dst).items():
        if s == rank:
            out[d] = pack_heads(pool, request_id, [r.src_local for r in routes])
    return out


def _check_frame(header: KVFrameHeader, pool: KVPool, routes: list[HeadRoute], request_id: str) -> None:
    if header.request_id != request_id:
        raise TransferError(TransferFailure.REQUEST_MISMATCH,
                            f"expected the pages of {request_id!r}, got those of {header.request_id!r}", request_id)
    want = (pool.num_layers, pool.page_size, len(routes), pool.head_dim, _DTYPE_NAMES[pool.dtype])
    got = (header.num_layers, header.page_size, header.num_kv_heads, header.head_dim, header.dtype)
    if want != got:
        raise TransferError(TransferFailure.SHAPE, "(num_layers, page_size, num_kv_heads, head_dim, dtype): this "
                            f"rank expects {want} from the frame, got {got}", request_id)
    if pool.k_scale is not None:
        heads = [r.dst_local for r in routes]
        mine = (tuple(float(x) for x in pool.k_scale[:, heads].flatten().tolist()),
                tuple(float(x) for x in pool.v_scale[:, heads].flatten().tolist()))
        if (header.k_scale, header.v_scale) != mine:
            raise TransferError(TransferFailure.SHAPE, "FP8 scales of the frame's heads differ from this rank's",
                                request_id)


def adopt_head_frames(pool: KVPool, frames: Mapping[int, Any], routes: Sequence[HeadRoute],
                      request_id: str) -> list[int]:
    """Decode rank side: ``frames`` ``{prefill rank: frame}`` carry this rank's heads as
    ``routes`` (its part of :func:`head_routes`) say. Every frame is checked before a page is
    taken; on any failure nothing stays allocated. Returns the page list."""
    by_src: dict[int, list[HeadRoute]] = {}
    for r in routes:
        by_src.setdefault(r.src_rank, []).append(r)
    if sorted(by_src) != sorted(frames):
        raise TransferError(TransferFailure.LOST, f"expected frames from prefill ranks {sorted(by_src)}, got "
                            f"{sorted(frames)}", request_id)
    if sorted(r.dst_local for r in routes) != list(range(pool.num_kv_heads)):
        raise TransferError(TransferFailure.SHAPE, f"the routes fill heads {sorted(r.dst_local for r in routes)} of "
                            f"this rank's {pool.num_kv_heads}", request_id)
    checked = {}
    for s, frame in frames.items():
        header, payload = read_frame(frame)
        _check_frame(header, pool, by_src[s], request_id)
        checked[s] = (header, payload)
    tokens = {h.num_tokens for h, _ in checked.values()}
    if len(tokens) != 1:
        raise TransferError(TransferFailure.MALFORMED, f"the frames disagree on the token count: {sorted(tokens)}",
                            request_id)
    header = next(iter(checked.values()))[0]
    pages = adopt_pages(pool, header)
    try:
        index = torch.tensor(pages, dtype=torch.long, device=pool.device)
        for s, (h, payload) in checked.items():
            one = h.payload_bytes // 2
            with warnings.catch_warnings():  # read-only buffers (Ray's zero-copy get): we only read
                warnings.simplefilter("ignore", UserWarning)
                raw = torch.frombuffer(payload, dtype=torch.uint8)
            for part, dst in enumerate((pool.k_raw, pool.v_raw)):
                dst_bytes = dst.view(torch.uint8)
                hd = _head_dim_of(pool, part)
                shape = list(dst_bytes.shape)
                shape[1], shape[hd] = len(pages), len(by_src[s])
                block = raw[part * one:(part + 1) * one].view(shape).to(pool.device)
                for j, route in enumerate(by_src[s]):
                    dst_bytes.select(hd, route.dst_local).index_copy_(1, index, block.select(hd, j))
    except BaseException:
        pool.release(request_id)
        raise
    return pages


_OK = 1 << 20  # agree(): a rank's code when it succeeded; failures send their reason's index


def agree(error: TransferError | None, group: Any = None) -> TransferError | None:
    """The decode group's verdict: ``None`` if every rank succeeded, else a failing rank's
    reason (the lowest-numbered one) as a TransferError on every rank. ``group``: the decode
    replica's ``torch.distributed`` process group (``None``: a group of one)."""
    reasons = list(TransferFailure)
    code = _OK if error is None else reasons.index(error.reason)
    if group is not None:
        import torch.distributed as dist

        t = torch.tensor([code], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        group.allreduce([t], opts).wait()  # the ProcessGroup's own call (no default group needed)
        code = int(t)
    if code == _OK:
        return None
    if error is not None and reasons.index(error.reason) == code:
        return error
    return TransferError(reasons[code], "another rank of the decode group failed this transfer",
                         None if error is None else error.request_id)


def receive_rank(pool: KVPool, frames: Mapping[int, Any], routes: Sequence[HeadRoute], request_id: str,
                 group: Any = None) -> list[int]:
    """One decode rank's whole receive: adopt its frames, agree with the group, and release
    everything if any rank failed (raising that failure)."""
    error = None
    try:
        pages = adopt_head_frames(pool, frames, routes, request_id)
    except TransferError as exc:
        error = exc
    verdict = agree(error, group)
    if verdict is not None:
        if error is None:
            pool.release(request_id)
        raise verdict
    return pages


def transfer_groups(src_pools: Sequence[KVPool], src: HeadLayout, dst_pools: Sequence[KVPool], dst: HeadLayout,
                    request_id: str, *, retries: int = 1, fault: Any = None) -> int:
    """Driver for ranks whose pools this process reaches (tests, single-host tools): ship
    ``request_id`` from the prefill group's pools to the decode group's, all or nothing,
    retrying a retryable failure ``retries`` times. ``fault(attempt, src_rank, dst_rank,
    frame)`` may return a damaged frame (fault injection). Returns the attempts used."""
    if len(src_pools) != src.tp_size or len(dst_pools) != dst.tp_size:
        raise ValueError(f"src_pools, dst_pools: expected {src.tp_size} and {dst.tp_size} pools, got "
                         f"{len(src_pools)} and {len(dst_pools)}")
    routes = transfer_routes(src, dst)
    for attempt in range(retries + 1):
        sent: dict[int, dict[int, Any]] = {d: {} for d in range(dst.tp_size)}
        for s, pool in enumerate(src_pools):
            for d, frame in export_rank(pool, request_id, src, dst, s).items():
                sent[d][s] = frame if fault is None else fault(attempt, s, d, frame)
        errors: list[TransferError | None] = []
        for d, pool in enumerate(dst_pools):
            mine = [r for (s, dd), rs in routes.items() if dd == d for r in rs]
            try:
                adopt_head_frames(pool, sent[d], mine, request_id)
                errors.append(None)
            except TransferError as exc:
                errors.append(exc)
        failed = next((e for e in errors if e is not None), None)
        if failed is None:
            return attempt + 1
        for pool, e in zip(dst_pools, errors):
            if e is None:
                pool.release(request_id)
        if not failed.retryable or attempt == retries:
            raise failed
    raise AssertionError("unreachable")


def merge_frames(frames: Mapping[int, Any], src: HeadLayout) -> np.ndarray:
    """One ordinary frame of all KV heads (what a TP=1 pool would pack) from the frames a
    prefill group's ranks ship to a single decode rank (``export_rank(..., dst=TP 1)``): lets a
    TP prefill replica use the single-frame transports unchanged. Every frame is verified
    first (TransferError as ``read_frame``); the result carries its own CRC-32."""
    dst = HeadLayout(src.num_q_heads, src.num_kv_heads, 1)
    routes = [r for rs in transfer_routes(src, dst).values() for r in rs]
    by_src: dict[int, list[HeadRoute]] = {}
    for r in routes:
        by_src.setdefault(r.src_rank, []).append(r)
    if sorted(frames) != sorted(by_src):
        raise TransferError(TransferFailure.LOST, f"expected frames from prefill ranks {sorted(by_src)}, got "
                            f"{sorted(frames)}")
    checked = {s: read_frame(f) for s, f in frames.items()}
    first = checked[min(checked)][0]
    for s, (h, _) in checked.items():
        if (h.request_id, h.num_tokens, h.num_pages, h.num_layers, h.page_size, h.head_dim, h.dtype) != \
                (first.request_id, first.num_tokens, first.num_pages, first.num_layers, first.page_size,
                 first.head_dim, first.dtype) or h.num_kv_heads != len(by_src[s]):
            raise TransferError(TransferFailure.MALFORMED, f"the frame of prefill rank {s} does not match the others",
                                first.request_id)
    token_major_v = first.dtype == "float8_e4m3fn"
    parts, k_scale, v_scale = [], [], []
    heads = src.num_kv_heads
    for part in (0, 1):
        pieces = [None] * heads
        for s, (h, payload) in checked.items():
            one = h.payload_bytes // 2
            raw = np.frombuffer(payload, dtype=np.uint8)[part * one:(part + 1) * one]
            hd = 2 if part == 1 and token_major_v else 3
            shape = [h.num_layers, h.num_pages, h.page_size, h.num_kv_heads, -1]
            if hd == 2:
                shape = [h.num_layers, h.num_pages, h.num_kv_heads, h.head_dim, -1]
            block = raw.reshape(shape)
            for j, r in enumerate(by_src[s]):
                pieces[r.dst_local] = np.take(block, [j], axis=hd)
        parts.append(np.concatenate(pieces, axis=2 if part == 1 and token_major_v else 3).reshape(-1))
    if first.k_scale is not None:
        for name, out in (("k_scale", k_scale), ("v_scale", v_scale)):
            table = np.zeros((first.num_layers, heads), dtype=np.float64)
            for s, (h, _) in checked.items():
                mine = np.asarray(getattr(h, name), dtype=np.float64).reshape(first.num_layers, -1)
                for j, r in enumerate(by_src[s]):
                    table[:, r.dst_local] = mine[:, j]
            out.extend(float(x) for x in table.flatten())
    payload = np.concatenate(parts)
    header = dataclasses.replace(first, num_kv_heads=heads, payload_bytes=len(payload),
                                 checksum=zlib.crc32(memoryview(payload)),
                                 k_scale=tuple(k_scale) if k_scale else None, v_scale=tuple(v_scale) if v_scale else None)
    raw = header.encode()
    return np.concatenate([np.frombuffer(_PREFIX.pack(FRAME_MAGIC, len(raw)) + raw, dtype=np.uint8), payload])


# ---------------------------------------------------------------------------------------------
# receive side of a TP decode replica: one ordinary frame in, split by KV heads over its ranks
# ---------------------------------------------------------------------------------------------
def rank_routes(dst: HeadLayout, rank: int) -> list[HeadRoute]:
    """The routes decode rank ``rank`` of ``dst`` takes from an ordinary (TP=1) frame: its KV
    heads in its own order (source rank 0, source local head = the global head)."""
    src = HeadLayout(dst.num_q_heads, dst.num_kv_heads, 1)
    return list(transfer_routes(src, dst).get((0, dst._check_rank(rank)), []))


def split_frame(frame: Any, dst: HeadLayout, *, request_id: str | None = None) -> dict[int, np.ndarray]:
    """An ordinary frame of every KV head (what ``pack_pages`` or :func:`merge_frames` gives)
    cut into the frames of a decode group ``dst``: ``{decode rank: frame of exactly its KV
    heads}`` (a replicated head goes to each rank holding it), each with its own CRC-32 and its
    heads' FP8 scales. The whole frame is verified first (``read_frame``: TransferError), so a
    damaged frame never reaches a rank; ``request_id``: the request it must carry."""
    if not isinstance(dst, HeadLayout):
        raise ValueError(f"dst: expected a HeadLayout, got {type(dst).__name__}")
    header, payload = read_frame(frame)
    if request_id is not None and header.request_id != request_id:
        raise TransferError(TransferFailure.REQUEST_MISMATCH,
                            f"expected the pages of {request_id!r}, got those of {header.request_id!r}", request_id)
    if header.num_kv_heads != dst.num_kv_heads:
        raise TransferError(TransferFailure.SHAPE, f"num_kv_heads: this decode group holds {dst.num_kv_heads} KV "
                            f"heads, the frame {header.num_kv_heads}", header.request_id)
    one = header.payload_bytes // 2
    token_major_v = header.dtype == "float8_e4m3fn"  # FP8 pools keep V token-major (as merge_frames)
    h = header
    blocks = []
    for part in (0, 1):
        raw = np.frombuffer(payload, dtype=np.uint8)[part * one:(part + 1) * one]
        if part == 1 and token_major_v:
            blocks.append((2, raw.reshape(h.num_layers, h.num_pages, h.num_kv_heads, h.head_dim, -1)))
        else:
            blocks.append((3, raw.reshape(h.num_layers, h.num_pages, h.page_size, h.num_kv_heads, -1)))
    out = {}
    for rank in range(dst.tp_size):
        heads = [r.src_local for r in rank_routes(dst, rank)]
        body = np.concatenate([np.take(block, heads, axis=axis).reshape(-1) for axis, block in blocks])
        k_scale = v_scale = None
        if h.k_scale is not None:
            k_scale = tuple(float(x) for x in np.asarray(h.k_scale).reshape(h.num_layers, -1)[:, heads].flatten())
            v_scale = tuple(float(x) for x in np.asarray(h.v_scale).reshape(h.num_layers, -1)[:, heads].flatten())
        sub = dataclasses.replace(h, num_kv_heads=len(heads), payload_bytes=len(body),
                                  checksum=zlib.crc32(memoryview(body)), k_scale=k_scale, v_scale=v_scale)
        raw_header = sub.encode()
        out[rank] = np.concatenate([np.frombuffer(_PREFIX.pack(FRAME_MAGIC, len(raw_header)) + raw_header,
                                                  dtype=np.uint8), body])
    return out


def adopt_rank_frame(pool: KVPool, frame: Any, dst: HeadLayout, rank: int, request_id: str) -> TransferError | None:
    """Decode rank ``rank``'s side of :func:`split_frame`: verify and adopt its frame (nothing
    stays allocated on a failure); the failure is *returned* (the driver tallies every rank's
    outcome: :func:`settle`), never raised."""
    try:
        adopt_head_frames(pool, {0: frame}, rank_routes(dst, rank), request_id)
    except TransferError as exc:
        return exc
    return None


def settle(outcomes: Sequence[TransferError | None], release: Any) -> None:
    """The driver's tally of a decode group's receive (all or nothing): if any rank failed,
    ``release()`` (every rank lets the request's pages go; a rank that took none releases
    nothing) and raise the lowest-numbered rank's failure (retryable as its reason is)."""
    failed = next((e for e in outcomes if e is not None), None)
    if failed is None:
        return
    release()
    raise failed
